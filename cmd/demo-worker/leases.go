package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
	"golang.org/x/sync/errgroup"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// leaseResult is what the -leases experiment prints.
type leaseResult struct {
	Clients int           `json:"clients"`
	Leases  int           `json:"leases"`
	Limit   string        `json:"limit"`
	Work    time.Duration `json:"work_ns"`
	Jobs    int           `json:"jobs"`    // jobs that ran
	Peak    int           `json:"peak"`    // most jobs running at once, as the workers saw it
	Refused int           `json:"refused"` // slots refused (beyond the max wait) while holding a lease
	Elapsed time.Duration `json:"elapsed_ns"`
}

// leaseDemo runs the -leases experiment: -clients workers run jobs of
// -work each on one key, every job holding one of -leases leases (a
// concurrency limit across processes) and starting at a slot of the rate
// limit. The lease comes first, then the slot: see package lease.
func leaseDemo(ctx context.Context, o options, stdout io.Writer) error {
	ropts, where, closeRedis, err := connect(o.redisURL)
	if err != nil {
		return err
	}
	defer closeRedis()
	if err := reach(ctx, ropts, where); err != nil {
		return err
	}
	rdb := redis.NewClient(ropts)
	defer rdb.Close()
	prefix := "slotbook-demo:" + strconv.FormatInt(time.Now().UnixNano(), 36) + ":"
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(time.Second))
	if err != nil {
		return err
	}
	sem, err := lease.New(eng, "demo-lease", o.leases, lease.WithTTL(10*time.Second))
	if err != nil {
		return err
	}
	defer sem.Close(context.WithoutCancel(ctx))
	limit := throttle.Every(o.period, o.rate, o.burst)
	lim, err := reserve.New(eng, "demo-lease", limit, reserve.WithMaxWait(o.maxWait))
	if err != nil {
		return err
	}
	if !o.json {
		fmt.Fprintf(stdout, "slotbook demo: %d clients share %d leases and %v, jobs of %v, for %v (%s)\n\n",
			o.clients, o.leases, limit, o.work, o.duration, where)
	}

	var (
		mu                 sync.Mutex // guards the counts
		inside, peak, jobs int
		refused            int
		start              = time.Now()
		stop               = start.Add(o.duration)
		g, gctx            = errgroup.WithContext(ctx)
	)
	for c := 0; c < o.clients; c++ {
		g.Go(func() error {
			for time.Now().Before(stop) {
				l, err := sem.Acquire(gctx, "partner")
				if err != nil {
					return err
				}
				err = lim.Acquire(gctx, "partner")
				if err != nil {
					_ = l.Release(context.WithoutCancel(gctx))
					retry, ok := deadline.RetryAfterOf(err)
					if !ok {
						return err
					}
					mu.Lock()
					refused++
					mu.Unlock()
					time.Sleep(retry)
					continue
				}
				mu.Lock()
				inside++
				peak = max(peak, inside)
				mu.Unlock()
				time.Sleep(o.work)
				mu.Lock()
				inside--
				jobs++
				mu.Unlock()
				if err := l.Release(gctx); err != nil && !errors.Is(err, context.Canceled) {
					return err
				}
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return err
	}
	res := leaseResult{Clients: o.clients, Leases: o.leases, Limit: limit.String(), Work: o.work,
		Jobs: jobs, Peak: peak, Refused: refused, Elapsed: time.Since(start)}
	if o.json {
		return json.NewEncoder(stdout).Encode(res)
	}
	fmt.Fprintf(stdout, "%d jobs ran in %v; at most %d at once (the lease limit is %d); %d slots refused beyond the max wait\n",
		res.Jobs, res.Elapsed.Round(time.Millisecond), res.Peak, res.Leases, res.Refused)
	return nil
}
