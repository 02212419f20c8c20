package throttle

import (
	"context"
	"slices"

	"github.com/redis/go-redis/v9"
)

// A script is a Lua script the engine runs: EVALSHA, and EVAL when Redis
// answers NOSCRIPT (after a restart or SCRIPT FLUSH), as go-redis's
// Script.Run does, with one difference: go-redis is told never to retry a
// call that may have reached Redis.
//
// go-redis retries a command whose connection broke after it was written
// (MaxRetries, 3 by default). For a booking that runs the script twice:
// the caller gets the second reply and holds one booking, while the first
// one's slots go unused, with no error to say so; and a retry that then
// fails to dial would report "nothing sent" for a call that booked. So the
// engine sends its own commands, marked NoRetry, through the client's
// Process, and a lost reply surfaces as ErrReplyLost. (A client that cannot
// Process commands, some other Scripter, is run through Script.Run.)
type script struct {
	*redis.Script
	src string
	// hash and body are Hash() and src as command arguments, boxed once:
	// a string put in an []any on every call would cost an allocation.
	hash, body any
}

func newScript(src string) *script {
	s := &script{Script: redis.NewScript(src), src: src}
	s.hash, s.body = s.Hash(), src
	return s
}

// processor is what go-redis's clients (Client, ClusterClient, Ring) offer
// beyond Scripter: sending a command of the caller's making.
type processor interface {
	Process(ctx context.Context, cmd redis.Cmder) error
}

// onceCmd is a command go-redis must not retry once it may have been sent.
type onceCmd struct{ *redis.Cmd }

// NoRetry implements redis.Cmder.
func (onceCmd) NoRetry() bool { return true }

// run runs s on keys with args through rdb and returns its reply.
func (s *script) run(ctx context.Context, rdb redis.Scripter, keys []string, args []any) (any, error) {
	return s.runCmd(ctx, rdb, keys, append(cmdArgs(len(keys), len(args)), args...))
}

// cmdArgs returns a command's argument list with room for nargs script
// arguments after its head: the command's name, the script, the number of
// keys and nkeys keys, which runCmd fills in. A caller that appends its
// arguments to it saves run's copy of them, and an allocation.
func cmdArgs(nkeys, nargs int) []any {
	return make([]any, 3+nkeys, 3+nkeys+nargs)
}

// runCmd is run with the arguments after a's head (see cmdArgs).
func (s *script) runCmd(ctx context.Context, rdb redis.Scripter, keys []string, a []any) (any, error) {
	head := 3 + len(keys)
	p, ok := rdb.(processor)
	if !ok {
		// A copy of keys: they go to an interface's method, so keys would
		// escape, and every caller's keys with them, where a go-redis
		// client (a processor) needs no copy.
		return s.Run(ctx, rdb, slices.Clone(keys), a[head:]...).Result()
	}
	a[0], a[1], a[2] = "evalsha", s.hash, len(keys)
	for i, k := range keys {
		a[3+i] = k
	}
	cmd := onceCmd{redis.NewCmd(ctx, a...)}
	// HasErrorPrefix(nil, ...) allocates: look only at an error.
	if err := p.Process(ctx, cmd); err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
		// A new list: the first command keeps its own.
		b := append([]any{"eval", s.body}, a[2:]...)
		cmd = onceCmd{redis.NewCmd(ctx, b...)}
		_ = p.Process(ctx, cmd)
	}
	return cmd.Result()
}
