// Package contention runs the seed experiment: N clients share one limit
// for a while, each doing as many requests as it can, in one of several
// modes. The demo and the benchmark command both print its results.
package contention

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/pool"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// Config is one run's setting.
type Config struct {
	Clients  int
	Limit    throttle.Limit
	Duration time.Duration // clients start new requests only within it
	MaxWait  time.Duration // reservation modes' max wait
	// Calls returns the Redis round trips made so far by the client the
	// limiter uses.
	Calls func() int64
	// Progress, if set, is called about four times a second with the
	// requests through so far.
	Progress func(elapsed time.Duration, through int)
	// Start, if set, is when the clients begin (processes of a distributed
	// run agree on it), and what start times are measured from.
	Start time.Time
}

// Result is one mode's outcome.
type Result struct {
	Mode            string            `json:"mode"`
	Clients         int               `json:"clients"`
	Limit           string            `json:"limit"`
	Through         int               `json:"through"`     // requests that started
	Calls           int64             `json:"redis_calls"` // Redis round trips
	Denials         int               `json:"denials"`     // denied checks or refused bookings
	CallsPerRequest float64           `json:"calls_per_request"`
	MeanSpacing     time.Duration     `json:"mean_spacing_ns"` // between starts after the first burst
	MinSpacing      time.Duration     `json:"min_spacing_ns"`  // between starts after the first burst
	MaxBookedWait   time.Duration     `json:"max_booked_wait_ns"`
	Elapsed         time.Duration     `json:"elapsed_ns"`          // until the last request started
	Starts          []time.Duration   `json:"starts_ns,omitempty"` // each start, from the run's beginning, sorted
	ByClient        [][]time.Duration `json:"-"`                   // each client's starts
}

// recorder collects starts from concurrent clients.
type recorder struct {
	t0       time.Time
	mu       sync.Mutex // guards byClient, denials and maxWait
	byClient [][]time.Duration
	denials  int
	maxWait  time.Duration
	through  atomic.Int64
}

func newRecorder(clients int, start time.Time) *recorder {
	if start.IsZero() {
		start = time.Now()
	}
	return &recorder{t0: start, byClient: make([][]time.Duration, clients)}
}

func (r *recorder) start(client int) {
	d := time.Since(r.t0)
	r.through.Add(1)
	r.mu.Lock()
	r.byClient[client] = append(r.byClient[client], d)
	r.mu.Unlock()
}

func (r *recorder) deny() {
	r.mu.Lock()
	r.denials++
	r.mu.Unlock()
}

func (r *recorder) booked(wait time.Duration) {
	r.mu.Lock()
	r.maxWait = max(r.maxWait, wait)
	r.mu.Unlock()
}

// Modes are the modes Run knows, in the order they are usually shown.
var Modes = []string{"retry", "reserve", "pool"}

// Run runs the named mode (one of Modes).
func Run(ctx context.Context, mode string, lim *reserve.Limiter, key string, cfg Config) (Result, error) {
	switch mode {
	case "retry":
		return Retry(ctx, lim, key, cfg)
	case "reserve":
		return Reserve(ctx, lim, key, cfg)
	case "pool":
		return Pool(ctx, lim, key, cfg)
	}
	return Result{}, fmt.Errorf("contention: unknown mode %q", mode)
}

// Retry is retry-after-denial: each client checks, and on a denial sleeps
// exactly the retry-after it was given and checks again.
func Retry(ctx context.Context, lim *reserve.Limiter, key string, cfg Config) (Result, error) {
	return run(ctx, "retry", cfg, func(ctx context.Context, rec *recorder, client int) error {
		r, err := lim.Allow(ctx, key)
		if err != nil {
			return err
		}
		if !r.Allowed {
			rec.deny()
			return sleep(ctx, r.RetryAfter)
		}
		rec.start(client)
		return nil
	})
}

// Reserve is reservation: each client books the next slot with one call,
// sleeps until it, and goes.
func Reserve(ctx context.Context, lim *reserve.Limiter, key string, cfg Config) (Result, error) {
	return run(ctx, "reserve", cfg, func(ctx context.Context, rec *recorder, client int) error {
		r, err := lim.Reserve(ctx, key)
		if err != nil {
			return err
		}
		if !r.OK() {
			rec.deny()
			return sleep(ctx, r.RetryAfter()-cfg.MaxWait)
		}
		rec.booked(r.Delay())
		if err := r.Wait(ctx); err != nil {
			return err
		}
		rec.start(client)
		return nil
	})
}

// Pool is the worker pool: a pool with one worker per client books slots
// for its backlog in batches; each client submits a job and waits for it,
// then submits the next.
func Pool(ctx context.Context, lim *reserve.Limiter, key string, cfg Config) (Result, error) {
	p, err := pool.New(lim, pool.WithWorkers(cfg.Clients))
	if err != nil {
		return Result{}, err
	}
	defer p.Close(context.WithoutCancel(ctx))
	return run(ctx, "pool", cfg, func(ctx context.Context, rec *recorder, client int) error {
		j, err := p.Submit(ctx, key, func(context.Context) error {
			rec.start(client)
			return nil
		})
		if err != nil {
			return err
		}
		err = j.Wait(ctx)
		if r := j.Reservation(); r != nil && r.OK() {
			rec.booked(r.Booking().Wait)
		}
		if errors.Is(err, deadline.ErrMaxWaitExceeded) || errors.Is(err, deadline.ErrWouldExceedDeadline) {
			rec.deny()
			return nil
		}
		return err
	})
}

// run drives cfg.Clients clients, each calling step until the duration is
// over, and summarizes.
func run(ctx context.Context, mode string, cfg Config, step func(context.Context, *recorder, int) error) (Result, error) {
	if cfg.Clients <= 0 || cfg.Duration <= 0 {
		return Result{}, errors.New("contention: clients and duration must be positive")
	}
	if err := sleep(ctx, time.Until(cfg.Start)); err != nil {
		return Result{}, err
	}
	calls0 := cfg.Calls()
	rec := newRecorder(cfg.Clients, cfg.Start)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()

	var (
		wg       sync.WaitGroup
		errOnce  sync.Once
		firstErr error
	)
	for c := 0; c < cfg.Clients; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil && time.Since(rec.t0) < cfg.Duration {
				if err := step(ctx, rec, c); err != nil {
					errOnce.Do(func() { firstErr = err; cancel() })
					return
				}
			}
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	for running := true; running; {
		select {
		case <-done:
			running = false
		case <-tick.C:
			if cfg.Progress != nil {
				cfg.Progress(time.Since(rec.t0), int(rec.through.Load()))
			}
		}
	}
	if firstErr != nil {
		return Result{}, fmt.Errorf("%s: %w", mode, firstErr)
	}
	if err := ctx.Err(); err != nil {
		return Result{}, err
	}
	return summarize(mode, cfg, rec, cfg.Calls()-calls0), nil
}

// Spacing returns the mean and minimum gap between sorted starts after the
// first burst (which passes at once).
func Spacing(starts []time.Duration, burst int) (mean, least time.Duration) {
	tail := starts[min(burst, len(starts)):]
	if len(tail) < 2 {
		return 0, 0
	}
	least = tail[1] - tail[0]
	for i := 2; i < len(tail); i++ {
		least = min(least, tail[i]-tail[i-1])
	}
	return (tail[len(tail)-1] - tail[0]) / time.Duration(len(tail)-1), least
}

func summarize(mode string, cfg Config, rec *recorder, calls int64) Result {
	res := Result{
		Mode: mode, Clients: cfg.Clients, Limit: cfg.Limit.String(),
		Calls: calls, Denials: rec.denials, MaxBookedWait: rec.maxWait,
		ByClient: rec.byClient,
	}
	for _, s := range rec.byClient {
		res.Starts = append(res.Starts, s...)
	}
	slices.Sort(res.Starts)
	res.Through = len(res.Starts)
	if res.Through > 0 {
		res.CallsPerRequest = float64(calls) / float64(res.Through)
		res.Elapsed = res.Starts[len(res.Starts)-1]
	}
	res.MeanSpacing, res.MinSpacing = Spacing(res.Starts, cfg.Limit.Burst)
	return res
}

func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Throughput has goroutines reserve total slots on key between them, as
// fast as they can (the first total%goroutines of them one more than the
// rest, so that exactly total are reserved), and returns reservations per
// second and Redis calls per reservation. With a limit that is never
// reached it measures the cost of a reservation, coalesced or not.
func Throughput(ctx context.Context, lim *reserve.Limiter, key string, goroutines, total int, calls func() int64) (perSec, callsPer float64, err error) {
	if goroutines <= 0 || total <= 0 {
		return 0, 0, errors.New("contention: goroutines and total must be positive")
	}
	n := float64(total)
	before := calls()
	start := time.Now()
	var (
		wg   sync.WaitGroup
		once sync.Once
	)
	for g := 0; g < goroutines; g++ {
		each := total / goroutines
		if g < total%goroutines {
			each++
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < each; i++ {
				if _, rerr := lim.Reserve(ctx, key); rerr != nil {
					once.Do(func() { err = rerr })
					return
				}
			}
		}()
	}
	wg.Wait()
	return n / time.Since(start).Seconds(), float64(calls()-before) / n, err
}
