package main

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/throttle"
)

// leaseProbe returns the latency row of a lease: one Acquire and its
// Release on a key nobody else holds (two script calls, timed together),
// named with the Redis calls per lease measured first, alone and under
// contention. close stops the semaphore.
func leaseProbe(ctx context.Context, ropts *redis.Options, eng *throttle.Engine, run string) (p probe, close func(), err error) {
	alone, contended, err := leaseCalls(ctx, ropts, run)
	if err != nil {
		return probe{}, nil, err
	}
	sem, err := lease.New(eng, run+"-lease", 1_000_000, lease.WithTTL(time.Minute))
	if err != nil {
		return probe{}, nil, err
	}
	if err := sem.Load(ctx); err != nil {
		return probe{}, nil, err
	}
	name := fmt.Sprintf("slotbook lease (Acquire + Release; calls per lease: %.2f alone, %.2f contended)", alone, contended)
	return probe{name: name, command: "evalsha", call: func(ctx context.Context) error {
			l, err := sem.Acquire(ctx, "lat")
			if err != nil {
				return err
			}
			return l.Release(ctx)
		}}, func() {
			_ = sem.Close(context.Background())
		}, nil
}

// leaseCalls counts the Redis round trips per lease: alone (one process,
// no contention), and contended (two processes of 8 goroutines each on
// one key with N = 2, each lease held 1 ms: acquire, the wake-up, release,
// and the keepers' extension and poll calls).
func leaseCalls(ctx context.Context, ropts *redis.Options, run string) (alone, contended float64, err error) {
	type proc struct {
		calls *callcount.Counter
		sem   *lease.Semaphore
	}
	var procs []proc
	for range 2 {
		rdb := redis.NewClient(ropts)
		defer rdb.Close()
		calls := callcount.Attach(rdb)
		eng, err := throttle.New(rdb, throttle.WithPrefix("slotbench:"+run+":"), throttle.WithTimeout(5*time.Second))
		if err != nil {
			return 0, 0, err
		}
		sem, err := lease.New(eng, "lease", 2, lease.WithTTL(10*time.Second))
		if err != nil {
			return 0, 0, err
		}
		defer sem.Close(context.Background())
		if err := sem.Load(ctx); err != nil {
			return 0, 0, err
		}
		procs = append(procs, proc{calls, sem})
	}
	const n = 500
	before := procs[0].calls.Load()
	for range n {
		l, err := procs[0].sem.Acquire(ctx, "alone")
		if err != nil {
			return 0, 0, err
		}
		if err := l.Release(ctx); err != nil {
			return 0, 0, err
		}
	}
	alone = float64(procs[0].calls.Load()-before) / n

	before = procs[0].calls.Load() + procs[1].calls.Load()
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	const per = 25
	for g := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range per {
				l, err := procs[g%2].sem.Acquire(ctx, "contended")
				if err != nil {
					errs <- err
					return
				}
				time.Sleep(time.Millisecond)
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
		return 0, 0, err
	}
	contended = float64(procs[0].calls.Load()+procs[1].calls.Load()-before) / (16 * per)
	// The token counters outlive the leases (see package lease).
	rdb := redis.NewClient(ropts)
	defer rdb.Close()
	_ = rdb.Del(ctx, "slotbench:"+run+":lease:{alone}:lease:c", "slotbench:"+run+":lease:{contended}:lease:c").Err()
	return alone, contended, nil
}
