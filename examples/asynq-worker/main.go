// Command asynq-worker is an asynq server whose handlers share one rate
// limit with every other server on the same Redis, plus a producer.
//
//	go run ./examples/asynq-worker -redis redis://127.0.0.1:6379/0 -produce 50   # enqueue 50 tasks
//	go run ./examples/asynq-worker -redis redis://127.0.0.1:6379/0 -serve        # run a server until Ctrl-C
//	go run ./examples/asynq-worker -redis redis://127.0.0.1:6379/0               # both: enqueue 30, serve until done
//
// Start several servers at once: together they still call the "partner
// API" at most 5 times a second.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/slotbook/slotbook/asynqadapter"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

const taskType = "partner:call"

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "asynq-worker:", err)
		os.Exit(2)
	}
}

func run(ctx context.Context, args []string, out io.Writer) error {
	fs := flag.NewFlagSet("asynq-worker", flag.ContinueOnError)
	url := fs.String("redis", "redis://127.0.0.1:6379/0", "Redis URL")
	produce := fs.Int("produce", 0, "enqueue this many tasks and exit")
	serve := fs.Bool("serve", false, "run a server until interrupted")
	queue := fs.String("queue", "slotbook-example", "asynq queue")
	if err := fs.Parse(args); err != nil {
		return err
	}
	opts, err := redis.ParseURL(*url)
	if err != nil {
		return fmt.Errorf("-redis: %w", err)
	}
	opts.ContextTimeoutEnabled = true // so that slotbook's tight timeouts hold
	rdb := redis.NewClient(opts)
	defer rdb.Close()

	switch {
	case *produce > 0:
		return enqueue(rdb, *queue, *produce)
	case *serve:
		srv, _, err := start(rdb, *queue, out)
		if err != nil {
			return err
		}
		<-ctx.Done()
		srv.Shutdown()
		return nil
	default:
		const n = 30
		if err := enqueue(rdb, *queue, n); err != nil {
			return err
		}
		srv, done, err := start(rdb, *queue, out)
		if err != nil {
			return err
		}
		defer srv.Shutdown()
		for i := 0; i < n; i++ {
			select {
			case <-done:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return nil
	}
}

func enqueue(rdb *redis.Client, queue string, n int) error {
	client := asynq.NewClientFromRedisClient(rdb)
	for i := 0; i < n; i++ {
		if _, err := client.Enqueue(asynq.NewTask(taskType, []byte(fmt.Sprint(i))), asynq.Queue(queue)); err != nil {
			return err
		}
	}
	return nil
}

// start runs an asynq server whose handler calls the partner API at most
// 5 times a second across every server sharing the Redis.
func start(rdb *redis.Client, queue string, out io.Writer) (*asynq.Server, <-chan struct{}, error) {
	eng, err := throttle.New(rdb)
	if err != nil {
		return nil, nil, err
	}
	lim, err := reserve.New(eng, "partner-api", throttle.PerSecond(5, 2), reserve.WithMaxWait(3*time.Second))
	if err != nil {
		return nil, nil, err
	}
	var (
		mu    sync.Mutex // guards out and count
		count int
	)
	srv := asynq.NewServerFromRedisClient(rdb, asynq.Config{
		Concurrency:              10,
		Queues:                   map[string]int{queue: 1},
		IsFailure:                asynqadapter.IsFailure,           // a refusal is not a failure
		RetryDelayFunc:           asynqadapter.RetryDelayFunc(nil), // refused tasks come back when there is room
		DelayedTaskCheckInterval: time.Second,                      // and are looked at every second
		TaskCheckInterval:        100 * time.Millisecond,           // idle workers look for tasks this often
		LogLevel:                 asynq.WarnLevel,
		// asynq calls its ErrorHandler for refusals too: report the rest.
		ErrorHandler: asynq.ErrorHandlerFunc(func(_ context.Context, t *asynq.Task, err error) {
			if !asynqadapter.IsRefusal(err) {
				mu.Lock()
				fmt.Fprintf(out, "task %s failed: %v\n", t.Payload(), err)
				mu.Unlock()
			}
		}),
	})
	mw, err := asynqadapter.NewMiddleware(lim,
		asynqadapter.WithWorkEstimate(100*time.Millisecond), // the slot leaves the handler this long before its timeout
		asynqadapter.WithBookedRetries(eng, time.Minute),    // a task sent back keeps the slot booked for it
		asynqadapter.WithCheckInterval(time.Second))         // the DelayedTaskCheckInterval above
	if err != nil {
		return nil, nil, err
	}
	mux := asynq.NewServeMux()
	mux.Use(mw)
	done := make(chan struct{}, 1024)
	t0 := time.Now()
	mux.HandleFunc(taskType, func(ctx context.Context, t *asynq.Task) error {
		// Here the partner API would be called.
		mu.Lock()
		count++
		fmt.Fprintf(out, "task %3s started at %6.2fs (%d so far)\n", t.Payload(), time.Since(t0).Seconds(), count)
		mu.Unlock()
		select {
		case done <- struct{}{}:
		default:
		}
		return nil
	})
	if err := srv.Start(mux); err != nil {
		return nil, nil, err
	}
	return srv, done, nil
}
