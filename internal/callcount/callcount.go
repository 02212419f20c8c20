// Package callcount counts the round trips a go-redis client makes, for the
// tests, the demo and the benchmarks: a command is one call, and so is a
// pipeline. The handshake of a new connection (HELLO, CLIENT SETINFO, AUTH,
// SELECT) is not counted: it is paid once per pooled connection, not per
// request.
package callcount

import (
	"context"
	"sync/atomic"

	"github.com/redis/go-redis/v9"
)

// Counter is a go-redis hook; add it with client.AddHook. It is safe for
// concurrent use.
type Counter struct {
	n atomic.Int64
}

// Attach returns a Counter added to c.
func Attach(c *redis.Client) *Counter {
	cnt := new(Counter)
	c.AddHook(cnt)
	return cnt
}

// Load returns the number of round trips so far.
func (c *Counter) Load() int64 { return c.n.Load() }

// DialHook implements redis.Hook.
func (c *Counter) DialHook(next redis.DialHook) redis.DialHook { return next }

// ProcessHook implements redis.Hook.
func (c *Counter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if !handshake(cmd) {
			c.n.Add(1)
		}
		return next(ctx, cmd)
	}
}

// ProcessPipelineHook implements redis.Hook.
func (c *Counter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			if !handshake(cmd) {
				c.n.Add(1)
				break
			}
		}
		return next(ctx, cmds)
	}
}

func handshake(cmd redis.Cmder) bool {
	switch cmd.Name() {
	case "hello", "client", "auth", "select":
		return true
	}
	return false
}
