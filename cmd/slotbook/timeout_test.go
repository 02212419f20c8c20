package main

import (
	"context"
	"io"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
)

// TestTimeoutEachCall: -timeout bounds every call after the connection is
// made too (SCAN, the state script, reset), not only the first: the proxy
// turns slow once the client is connected.
func TestTimeoutEachCall(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	srv.RequireReal(t)
	p := redistest.NewProxy(t, srv.Addr)
	const timeout = 300 * time.Millisecond
	c := config{prefix: redistest.Prefix(t), timeout: timeout}
	require.NoError(t, c.limits.Set("1/10s:1"))
	opts, err := redis.ParseURL("redis://" + p.Addr())
	require.NoError(t, err)
	opts.ContextTimeoutEnabled = true
	opts.DialTimeout, opts.ReadTimeout, opts.WriteTimeout = timeout, timeout, timeout
	d := &db{client: redis.NewClient(opts), timeout: timeout}
	defer d.Close()
	ctx := context.Background()
	require.NoError(t, d.connect(ctx, opts))
	v, err := newViewer(d, c, "api")
	require.NoError(t, err)
	_, err = v.read(ctx, []string{"s"}) // connected and fast
	require.NoError(t, err)

	p.SetLatency(time.Minute)
	for name, f := range map[string]func() error{
		"scan": func() error { _, err := d.scan(ctx, subjectPattern(c.prefix, "api", "")); return err },
		"state": func() error {
			_, err := v.state(ctx, "s", &subjectKeys{live: map[time.Duration]string{}})
			return err
		},
		"reset": func() error { return v.reset(ctx, io.Discard, "s") },
	} {
		start := time.Now()
		err := f()
		el := time.Since(start)
		t.Logf("%s through a silent proxy: %v after %v", name, err, el)
		require.Error(t, err, name)
		require.Less(t, el, 3*timeout, name)
	}
}
