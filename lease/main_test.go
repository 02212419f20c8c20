package lease_test

import (
	"bufio"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/throttle"
)

// The tests that need several OS processes run this test binary again
// with LEASE_CHILD set: TestMain then plays the child and exits.
func TestMain(m *testing.M) {
	if mode := os.Getenv("LEASE_CHILD"); mode != "" {
		if err := child(mode); err != nil {
			fmt.Fprintln(os.Stderr, "child:", err)
			os.Exit(2)
		}
		os.Exit(0)
	}
	redistest.Main(m)
}

func envInt(name string) int {
	n, _ := strconv.Atoi(os.Getenv(name))
	return n
}

// child runs one child process of a multi-process test. Its lines on
// stdout are the parent's record; stdin, in mode fifo, its commands.
func child(mode string) error {
	// Timeouts far beyond any stall of a busy machine running eight of
	// these under the race detector: the tests judge the limit, not
	// latency.
	rdb := redis.NewClient(&redis.Options{Addr: os.Getenv("LEASE_ADDR"), ContextTimeoutEnabled: true,
		PoolSize: 64, ReadTimeout: 30 * time.Second, WriteTimeout: 30 * time.Second})
	defer rdb.Close()
	eng, err := throttle.New(rdb, throttle.WithPrefix(os.Getenv("LEASE_PREFIX")), throttle.WithTimeout(30*time.Second))
	if err != nil {
		return err
	}
	ttl, err := time.ParseDuration(os.Getenv("LEASE_TTL"))
	if err != nil {
		return err
	}
	sem, err := lease.New(eng, "partner", envInt("LEASE_N"), lease.WithTTL(ttl))
	if err != nil {
		return err
	}
	defer sem.Close(context.Background())
	key := os.Getenv("LEASE_KEY")
	var outMu sync.Mutex // guards out
	out := bufio.NewWriter(os.Stdout)
	say := func(format string, args ...any) {
		outMu.Lock()
		fmt.Fprintf(out, format+"\n", args...)
		out.Flush()
		outMu.Unlock()
	}
	ctx := context.Background()

	switch mode {
	case "stress":
		// Workers take a lease, record when they held it (wall clock,
		// shared by every process on the machine), and give it back,
		// until the run is over.
		run, err := time.ParseDuration(os.Getenv("LEASE_RUN"))
		if err != nil {
			return err
		}
		end := time.Now().Add(run)
		var wg sync.WaitGroup
		errs := make(chan error, envInt("LEASE_WORKERS"))
		for range envInt("LEASE_WORKERS") {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for time.Now().Before(end) {
					actx, cancel := context.WithTimeout(ctx, 60*time.Second)
					l, err := sem.Acquire(actx, key)
					cancel()
					if err != nil {
						errs <- err
						return
					}
					start := time.Now().UnixNano()
					time.Sleep(time.Duration(5+rand.IntN(10)) * time.Millisecond)
					stop := time.Now().UnixNano()
					select {
					case <-l.Lost():
						say("lost %d", l.Token())
					default:
					}
					say("hold %d %d %d", start, stop, l.Token())
					if err := l.Release(ctx); err != nil {
						errs <- err
						return
					}
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			return err
		}
		say("done")
	case "hold":
		// Take every lease, say so, and hold them until killed.
		for range envInt("LEASE_N") {
			if _, err := sem.Acquire(ctx, key); err != nil {
				return err
			}
		}
		say("held")
		time.Sleep(time.Hour)
	case "fifo":
		// "go NAME" starts a waiter; it says "got NAME TOKEN" once granted,
		// holds the lease briefly and gives it back. EOF ends the child
		// once its waiters are done.
		var wg sync.WaitGroup
		in := bufio.NewScanner(os.Stdin)
		for in.Scan() {
			name, ok := strings.CutPrefix(in.Text(), "go ")
			if !ok {
				continue
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				l, err := sem.Acquire(ctx, key)
				if err != nil {
					say("error %s %v", name, err)
					return
				}
				say("got %s %d", name, l.Token())
				time.Sleep(10 * time.Millisecond)
				if err := l.Release(ctx); err != nil {
					say("error %s %v", name, err)
				}
			}()
		}
		wg.Wait()
	default:
		return fmt.Errorf("unknown mode %q", mode)
	}
	return nil
}
