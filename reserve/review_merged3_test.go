package reserve_test

// Review of 8c7a33a from package reserve's side (ReserveN with coalescing
// off: a caller whose context ends while its merged call is out gets its
// context's error, its booking given back as unused), and of the default
// merging (WithMergeAt 4, WithMergeWait 250 µs) under package pool and
// reserve at 40 ms each way. The state a key is left in is told by a probe
// booking's wait, against a textbook GCRA (virtual scheduling, cell by
// cell) replayed here over the bookings callers actually hold, on the
// Redis clock (Booking().At - Booking().Wait is the decision time).

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/limitcheck"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/pool"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// m3Held is a booking a caller holds, as the textbook replay takes it.
func m3Held(b throttle.Booking) limitcheck.Outcome {
	return limitcheck.Outcome{Booking: b, N: 1, MaxWait: throttle.Forever}
}

// m3Probe checks, with a probe booking of one unit under l's limit (first
// limit only), that key is in the state held leaves it in. The probe's
// limiter must accept any wait (it books; the caller gives it back).
func m3Probe(t *testing.T, l *reserve.Limiter, key string, held []limitcheck.Outcome, what string) {
	t.Helper()
	tat, err := limitcheck.Replay(l.Limit(), 0, held)
	require.NoError(t, err, "%s: %s", what, key)
	r, err := l.Reserve(context.Background(), key)
	require.NoError(t, err, "%s: probe %s", what, key)
	b := r.Booking()
	_, want, _ := limitcheck.Judge(l.Limit(), tat, b.At.UnixMicro()-b.Wait.Microseconds(), 1, throttle.Forever)
	require.Equal(t, want, b.Wait.Microseconds(), "%s: %s: probe's wait (textbook over the %d bookings held)", what, key, len(held))
}

// m3Outcome is what a caller got, in words, for comparing the two modes.
func m3Outcome(r *reserve.Reservation, err error) string {
	switch {
	case err != nil && errors.Is(err, context.Canceled):
		return "ctx Canceled"
	case err != nil && errors.Is(err, context.DeadlineExceeded):
		return "ctx DeadlineExceeded"
	case err != nil:
		return "error: " + err.Error()
	case r.OK():
		return "OK Reservation"
	default:
		return "refused Reservation: " + r.Err().Error()
	}
}

// TestReviewM3EndedInFlightSides: ReserveN on an engine whose single
// bookings merge (WithMergeAt(1), WithMergeWait(Forever), a lone booking
// holding the one flight token, replies held back 150 ms), coalescing off
// and on (the control, in the same run); the caller's context ends while
// its merged call is out: cancelled once Redis holds its booking; a
// deadline that ends in flight; cancelled in flight while its request is
// refused (max wait 0 on a busy key). The key's state afterwards is the
// textbook's over what the caller holds (and a probe books the next), and
// both modes answer alike: ReserveN's doc (err non-nil for a done
// context), and the commit's word (as a coalesced caller does).
func TestReviewM3EndedInFlightSides(t *testing.T) {
	t.Parallel()
	outcomes := map[string]map[bool]string{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, side := range []string{"cancel-booked", "deadline-booked", "cancel-refused"} {
		for _, co := range []bool{true, false} {
			wg.Go(func() {
				t.Run(fmt.Sprintf("%s/coalescing=%v", side, co), func(t *testing.T) {
					got := m3EndedSide(t, side, co)
					mu.Lock()
					if outcomes[side] == nil {
						outcomes[side] = map[bool]string{}
					}
					outcomes[side][co] = got
					mu.Unlock()
				})
			})
		}
	}
	wg.Wait()
	for side, o := range outcomes {
		t.Logf("%s: coalesced %q, uncoalesced %q", side, o[true], o[false])
	}
	for side, o := range outcomes {
		if o[true] != "" && o[false] != "" {
			if o[true] != o[false] {
				t.Errorf("%s: a caller whose context ended while its merged call was out: coalesced %q, uncoalesced %q", side, o[true], o[false])
			}
		}
	}
}

func m3EndedSide(t *testing.T, side string, co bool) string {
	eng, p, prefix := proxiedEngine(t, 32, throttle.WithMergeAt(1), throttle.WithMergeWait(throttle.Forever))
	direct := redistest.Shared(t).Client(t)
	bg := context.Background()
	lim := throttle.PerSecond(2, 0) // 500 ms apart
	opts := []reserve.Option{reserve.WithCoalescing(co), reserve.WithoutMaxWait()}
	if side == "cancel-refused" {
		opts = []reserve.Option{reserve.WithCoalescing(co), reserve.WithMaxWait(0)}
	}
	name := fmt.Sprintf("m3s-%s-%v", side, co)
	l, err := reserve.New(eng, name, lim, opts...)
	require.NoError(t, err)
	probeL, err := reserve.New(eng, name, lim, reserve.WithoutMaxWait(), reserve.WithCoalescing(co))
	require.NoError(t, err)
	for round := 0; ; round++ {
		require.Less(t, round, 6, "never merged in flight")
		subject := fmt.Sprintf("s%d", round)
		key := prefix + name + ":{" + subject + "}"
		var held []limitcheck.Outcome
		if side == "cancel-refused" { // the key busy: the caller's request is refused
			r, err := probeL.Reserve(bg, subject)
			require.NoError(t, err)
			require.True(t, r.OK())
			held = append(held, m3Held(r.Booking()))
		}
		p.SetReplyDelay(150 * time.Millisecond)
		lone := make(chan error, 1)
		go func() {
			_, err := eng.Book(bg, fmt.Sprintf("lone-%s-%v-%d", side, co, round), lim, throttle.Request{N: 1, MaxWait: throttle.Forever})
			lone <- err
		}()
		time.Sleep(30 * time.Millisecond)
		var (
			ctx    context.Context
			cancel context.CancelFunc
		)
		if side == "deadline-booked" {
			ctx, cancel = context.WithTimeout(bg, 200*time.Millisecond)
		} else {
			ctx, cancel = context.WithCancel(bg)
		}
		type answer struct {
			r   *reserve.Reservation
			err error
		}
		done := make(chan answer, 1)
		sent := time.Now()
		go func() { r, err := l.Reserve(ctx, subject); done <- answer{r, err} }()
		inFlight := true
		switch side {
		case "cancel-booked":
			require.Eventually(t, func() bool { return direct.Exists(bg, key).Val() == 1 }, 5*time.Second, time.Millisecond)
			cancel()
		case "deadline-booked":
			require.Eventually(t, func() bool { return direct.Exists(bg, key).Val() == 1 || len(done) == 1 }, 5*time.Second, time.Millisecond)
			inFlight = len(done) == 0 && time.Since(sent) < 190*time.Millisecond
			if !inFlight {
				t.Logf("deadline: booked %v after %v", direct.Exists(bg, key).Val() == 1, time.Since(sent))
			}
		case "cancel-refused":
			time.Sleep(220 * time.Millisecond) // the batch went at ~120 ms; its reply comes at ~270 ms
			cancel()
		}
		a := <-done
		cancel()
		require.NoError(t, <-lone)
		p.SetReplyDelay(0)
		took := time.Since(sent)
		if !inFlight || took < 230*time.Millisecond {
			t.Logf("round %d: not ended in flight (booked in time: %v, answered after %v): again", round, inFlight, took)
			continue
		}
		got := m3Outcome(a.r, a.err)
		t.Logf("%s, coalescing %v: %s (answered after %v)", side, co, got, took)
		if a.err == nil && a.r.OK() {
			held = append(held, m3Held(a.r.Booking())) // its holder's
		}
		m3Probe(t, probeL, subject, held, side)
		// The ended caller's call was merged: a refused, or an errored,
		// caller holds nothing, and a late refusal's room came back.
		if a.err == nil && !a.r.OK() {
			require.False(t, a.r.Booking().OK && side != "cancel-refused", "a refused Reservation holding a booking")
		}
		return got
	}
}

// TestReviewM3EndedInFlightRace: coalescing off, single bookings merged
// (WithMergeAt(1), WithMergeWait(Forever), replies held back 30 ms), 32
// callers, each with subjects of its own that it books again and again;
// most calls' contexts end (cancelled, or a deadline) at a random time
// around the call's flight, so some end exactly as the reply arrives.
// Max waits: none, or 30 ms (refusals). A caller holds what it got as an
// OK Reservation (it never cancels); every key must be left as a textbook
// GCRA over the bookings held: a probe's wait tells. Acquire on subjects
// whose slots are all immediate: it holds its booking iff it returned nil.
func TestReviewM3EndedInFlightRace(t *testing.T) {
	t.Parallel()
	eng, p, _ := proxiedEngine(t, 48, throttle.WithMergeAt(1), throttle.WithMergeWait(throttle.Forever))
	lim := throttle.PerSecond(20, 1) // I = 50 ms, tau = 50 ms
	wide := throttle.PerHour(6, 6)   // seven at once: Acquire's slots immediate, none freed within the run
	mk := func(name string, l throttle.Limit, opts ...reserve.Option) *reserve.Limiter {
		x, err := reserve.New(eng, name, l, append([]reserve.Option{reserve.WithCoalescing(false)}, opts...)...)
		require.NoError(t, err)
		return x
	}
	free, capped, probe := mk("m3r", lim, reserve.WithoutMaxWait()), mk("m3r", lim, reserve.WithMaxWait(30*time.Millisecond)), mk("m3r", lim, reserve.WithoutMaxWait())
	acq, acqProbe := mk("m3a", wide, reserve.WithoutMaxWait()), mk("m3a", wide, reserve.WithoutMaxWait())
	p.SetReplyDelay(30 * time.Millisecond)
	const callers, rounds = 32, 6
	held := make([][]limitcheck.Outcome, callers)
	aheld := make([]int, callers) // Acquire bookings held
	var outcomes sync.Map
	count := func(s string) {
		v, _ := outcomes.LoadOrStore(s, new(atomic.Int64))
		v.(*atomic.Int64).Add(1)
	}
	var wg sync.WaitGroup
	for g := range callers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(g), 7))
			subject := fmt.Sprintf("c%d", g)
			for round := range rounds {
				bg := context.Background()
				ctx, cancel := context.WithCancel(bg)
				end := time.Duration(rng.IntN(90_000)) * time.Microsecond
				switch rng.IntN(4) {
				case 0: // no end
				case 1:
					ctx, cancel = context.WithTimeout(bg, end)
				default:
					timer := time.AfterFunc(end, cancel)
					defer timer.Stop()
				}
				if round%3 == 2 {
					err := acq.Acquire(ctx, subject)
					cancel()
					if err == nil {
						aheld[g]++
					}
					count(fmt.Sprintf("Acquire: %v", err == nil))
					continue
				}
				l := free
				if rng.IntN(2) == 0 {
					l = capped
				}
				r, err := l.Reserve(ctx, subject)
				if err == nil && r.OK() {
					held[g] = append(held[g], m3Held(r.Booking()))
				}
				count(func() string {
					s := m3Outcome(r, err)
					if len(s) > 40 {
						s = s[:40]
					}
					return s
				}())
				cancel()
			}
		})
	}
	m3WaitAll(t, &wg, 2*time.Minute, "callers")
	outcomes.Range(func(k, v any) bool { t.Logf("%-42s %d", k, v.(*atomic.Int64).Load()); return true })
	p.SetReplyDelay(0)
	for g := range callers {
		m3Probe(t, probe, fmt.Sprintf("c%d", g), held[g], "reserve")
	}
	// Acquire's subjects: all slots immediate, so the probe is immediate
	// iff at most Burst units stand, and its Booking says how many stand.
	for g := range callers {
		r, err := acqProbe.Reserve(context.Background(), fmt.Sprintf("c%d", g))
		require.NoError(t, err)
		b := r.Booking()
		// Each held Acquire booking was immediate, decided within the run
		// (seconds, under the 10 min interval): the probe is immediate.
		require.Zero(t, b.Wait, "c%d: Acquire subject (%d held): probe waits", g, aheld[g])
		// Units still free after the probe: Burst+1 - held - 1, as Allow's
		// Remaining tells; the textbook: each unit held costs one interval.
		res, err := eng.AllowN(context.Background(), "m3a:{"+fmt.Sprintf("c%d", g)+"}", wide, 1)
		require.NoError(t, err)
		if aheld[g]+2 <= wide.Burst+1 {
			require.True(t, res.Allowed, "c%d: %d held + probe: another unit must fit", g, aheld[g])
			require.Equal(t, wide.Burst+1-aheld[g]-2, res.Remaining, "c%d: %d Acquire bookings held, then a probe and an Allow: room left", g, aheld[g])
		}
	}
}

// TestReviewM3EndedLostOrStopped: coalescing off, merged (WithMergeAt(1),
// WithMergeWait(Forever)); callers whose context ends (or not) while the
// merged call is out, then the proxy severs every connection (replies
// lost), or Redis stops. No caller hangs, none gets an OK Reservation for
// a call whose reply never came, and each error is the context's or
// matches throttle.ErrUnavailable.
func TestReviewM3EndedLostOrStopped(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"sever", "stop"} {
		t.Run(how, func(t *testing.T) {
			t.Parallel()
			srv := redistest.Start(t)
			eng, p, _ := proxiedEngineOn(t, srv, 16, throttle.WithMergeAt(1), throttle.WithMergeWait(throttle.Forever), throttle.WithTimeout(3*time.Second))
			l, err := reserve.New(eng, "m3l", throttle.PerSecond(2, 0), reserve.WithCoalescing(false), reserve.WithoutMaxWait())
			require.NoError(t, err)
			p.SetReplyDelay(400 * time.Millisecond)
			var wg sync.WaitGroup
			type res struct {
				r     *reserve.Reservation
				err   error
				ended bool
			}
			out := make([]res, 12)
			for i := range out {
				wg.Go(func() {
					ctx, cancel := context.WithCancel(context.Background())
					defer cancel()
					if i%3 != 0 {
						time.AfterFunc(time.Duration(150+10*i)*time.Millisecond, cancel)
					}
					r, err := l.Reserve(ctx, fmt.Sprintf("s%d", i))
					out[i] = res{r, err, ctx.Err() != nil}
				})
				time.Sleep(5 * time.Millisecond)
			}
			time.Sleep(250 * time.Millisecond)
			if how == "sever" {
				p.Sever()
			} else {
				srv.Stop()
			}
			m3WaitAll(t, &wg, 20*time.Second, how)
			for i, o := range out {
				t.Logf("caller %d (ended %v): %s", i, o.ended, m3Outcome(o.r, o.err))
				if o.err == nil {
					// Only the lone booking's reply could have come before
					// the sever (it was not held back long enough): none.
					require.Failf(t, "an answer with no reply", "caller %d: %s", i, m3Outcome(o.r, o.err))
				}
				if !errors.Is(o.err, context.Canceled) {
					require.ErrorIs(t, o.err, throttle.ErrUnavailable, "caller %d", i)
				}
			}
		})
	}
}

// TestReviewM3PoolAndReserveAtLatency: the DEFAULT engine options (merging
// at four in flight, 250 µs) at 40 ms each way, a pool of 64 workers on
// 24 keys (each submitting six jobs, the next once the last is done, plus
// bursts of four at once) and 24 ReserveN callers (coalesced, the default)
// on keys of their own, six each, holding what they get. Every job runs
// once, at or after its slot; every key's bookings are a textbook GCRA
// sequence on the Redis clock (none booked twice, none given back that
// stands), its slots within the arrival curve, and a probe finds the
// state they leave (nothing lost).
func TestReviewM3PoolAndReserveAtLatency(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	eng, p, _ := proxiedEngineOn(t, srv, 0)
	p.SetLatency(40 * time.Millisecond)
	lim := throttle.PerSecond(25, 2) // I = 40 ms
	lp, err := reserve.New(eng, "m3pool", lim, reserve.WithoutMaxWait())
	require.NoError(t, err)
	lr, err := reserve.New(eng, "m3res", lim, reserve.WithoutMaxWait())
	require.NoError(t, err)
	pl, err := pool.New(lp, pool.WithWorkers(64))
	require.NoError(t, err)
	t.Cleanup(func() { _ = pl.Close(context.Background()) })

	const keys = 24
	var (
		mu      sync.Mutex
		jobs    = map[string][]limitcheck.Outcome{}
		res     = map[string][]limitcheck.Outcome{}
		ran     atomic.Int64
		wg      sync.WaitGroup
		errc    = make(chan error, 4*keys)
		started sync.Map
	)
	fail := func(format string, a ...any) {
		select {
		case errc <- fmt.Errorf(format, a...):
		default:
		}
	}
	for k := range keys {
		wg.Go(func() { // pool: one at a time, then a burst
			key := fmt.Sprintf("p%d", k)
			submit := func() *pool.Job {
				var once atomic.Int32
				j, err := pl.Submit(context.Background(), key, func(context.Context) error {
					if once.Add(1) > 1 {
						fail("%s: a job ran twice", key)
					}
					ran.Add(1)
					return nil
				})
				if err != nil {
					fail("%s: %v", key, err)
				}
				return j
			}
			record := func(j *pool.Job) {
				if j == nil {
					return
				}
				if err := j.Wait(context.Background()); err != nil {
					fail("%s: %v", key, err)
					return
				}
				r := j.Reservation()
				if r == nil || !r.OK() {
					fail("%s: a job ran without a booking", key)
					return
				}
				if j.Started().Before(r.SlotAt()) {
					fail("%s: started %v before its slot", key, r.SlotAt().Sub(j.Started()))
				}
				if _, dup := started.LoadOrStore(j, true); dup {
					fail("%s: one job twice", key)
				}
				mu.Lock()
				jobs[key] = append(jobs[key], m3Held(r.Booking()))
				mu.Unlock()
			}
			for range 6 {
				record(submit())
			}
			var burst []*pool.Job
			for range 4 {
				burst = append(burst, submit())
			}
			for _, j := range burst {
				record(j)
			}
		})
		wg.Go(func() { // reserve: six in a row, two at once
			key := fmt.Sprintf("r%d", k)
			for range 3 {
				var two sync.WaitGroup
				for range 2 {
					two.Go(func() {
						r, err := lr.Reserve(context.Background(), key)
						if err != nil || !r.OK() {
							fail("%s: %s", key, m3Outcome(r, err))
							return
						}
						mu.Lock()
						res[key] = append(res[key], m3Held(r.Booking()))
						mu.Unlock()
					})
				}
				two.Wait()
			}
		})
	}
	m3WaitAll(t, &wg, 3*time.Minute, "pool and reserve at 40 ms")
	close(errc)
	for err := range errc {
		require.NoError(t, err)
	}
	require.Equal(t, int64(keys*10), ran.Load(), "jobs run")
	p.SetLatency(0)
	for k := range keys {
		for _, c := range []struct {
			l    *reserve.Limiter
			key  string
			held []limitcheck.Outcome
		}{{lp, fmt.Sprintf("p%d", k), jobs[fmt.Sprintf("p%d", k)]}, {lr, fmt.Sprintf("r%d", k), res[fmt.Sprintf("r%d", k)]}} {
			var slots []rmaSlot
			for _, h := range c.held {
				slots = append(slots, rmaSlot{at: h.Booking.At.UnixMicro(), n: h.N})
			}
			rmaArrivalCurve(t, lim, slots, c.key)
			m3Probe(t, c.l, c.key, c.held, "40 ms, default merging")
		}
	}
}

// m3WaitAll waits for wg, failing the test if it takes over d.
func m3WaitAll(t *testing.T, wg *sync.WaitGroup, d time.Duration, what string) {
	t.Helper()
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("%s: callers still waiting after %v", what, d)
	}
}
