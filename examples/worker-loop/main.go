// Command worker-loop is the simplest use of slotbook: a loop that takes
// the next slot of a shared quota before each unit of work. Run several at
// once against one Redis and together they keep to the quota.
//
//	go run ./examples/worker-loop                                   # an embedded Redis
//	go run ./examples/worker-loop -redis redis://127.0.0.1:6379/0 -n 20
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "worker-loop:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, out io.Writer) error {
	fs := flag.NewFlagSet("worker-loop", flag.ContinueOnError)
	url := fs.String("redis", "", "Redis URL; empty: an embedded Redis")
	n := fs.Int("n", 12, "units of work to do")
	timeout := fs.Duration("timeout", throttle.DefaultTimeout, "bound on each Redis call")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *url == "" {
		mr, err := miniredis.Run()
		if err != nil {
			return err
		}
		defer mr.Close()
		*url = "redis://" + mr.Addr()
	}
	opts, err := redis.ParseURL(*url)
	if err != nil {
		return err
	}
	opts.ContextTimeoutEnabled = true
	rdb := redis.NewClient(opts)
	defer rdb.Close()

	eng, err := throttle.New(rdb, throttle.WithTimeout(*timeout))
	if err != nil {
		return err
	}
	// 4 a second, 2 extra back to back after idling; never wait over 5 s.
	lim, err := reserve.New(eng, "reports", throttle.PerSecond(4, 2), reserve.WithMaxWait(5*time.Second))
	if err != nil {
		return err
	}
	start := time.Now()
	for i := 0; i < *n; i++ {
		if err := lim.Acquire(ctx, "nightly"); err != nil {
			if errors.Is(err, reserve.ErrMaxWaitExceeded) {
				// Too busy: the error says when to come back.
				fmt.Fprintln(out, "busy:", err)
				continue
			}
			return err
		}
		fmt.Fprintf(out, "unit %2d at %5.2fs\n", i, time.Since(start).Seconds()) // the work
	}
	return nil
}
