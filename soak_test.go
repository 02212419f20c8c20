package slotbook_test

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/limitcheck"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

var soakFor = flag.Duration("soak", 5*time.Second, "how long TestSoak's processes start requests (the full soak: -soak 20s)")

// soakLimit is the soak's limit: 50/s, burst 2.
var soakLimit = throttle.PerSecond(50, 2)

// soakReport is what one soak worker process prints.
type soakReport struct {
	Confirmed int      `json:"confirmed"` // bookings made
	Refused   int      `json:"refused"`
	Started   []int64  `json:"started"` // unix ns, recorded by the worker itself
	Slots     []int64  `json:"slots"`   // unix µs on the Redis clock
	Called    []int64  `json:"called"`  // unix ns: when the booking's Reserve was called
	Waited    []int64  `json:"waited"`  // ns from the call to the start, on the monotonic clock
	Errors    []string `json:"errors"`
}

// soakWorker runs when the test binary is started as a soak worker (see
// TestMain): 25 goroutines reserving on one key until the deadline.
func soakWorker() int {
	opts := &redis.Options{Addr: os.Getenv("SOAK_ADDR"), ContextTimeoutEnabled: true}
	rdb := redis.NewClient(opts)
	defer rdb.Close()
	eng, err := throttle.New(rdb, throttle.WithPrefix(os.Getenv("SOAK_PREFIX")), throttle.WithTimeout(2*time.Second))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	// 200 workers at 50/s queue for 4 s: a 5 s max wait takes them all.
	lim, err := reserve.New(eng, "soak", soakLimit, reserve.WithMaxWait(5*time.Second))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	startNS, _ := strconv.ParseInt(os.Getenv("SOAK_START"), 10, 64)
	until, _ := strconv.ParseInt(os.Getenv("SOAK_UNTIL"), 10, 64)
	time.Sleep(time.Until(time.Unix(0, startNS)))
	var (
		mu  sync.Mutex // guards rep
		rep soakReport
		wg  sync.WaitGroup
	)
	ctx := context.Background()
	for g := 0; g < 25; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().UnixNano() < until {
				called := time.Now()
				r, err := lim.Reserve(ctx, "shared")
				if err != nil {
					mu.Lock()
					rep.Errors = append(rep.Errors, err.Error())
					mu.Unlock()
					return
				}
				if !r.OK() {
					mu.Lock()
					rep.Refused++
					mu.Unlock()
					time.Sleep(r.RetryAfter())
					continue
				}
				mu.Lock()
				rep.Confirmed++
				mu.Unlock()
				if err := r.Wait(ctx); err != nil {
					mu.Lock()
					rep.Errors = append(rep.Errors, err.Error())
					mu.Unlock()
					return
				}
				now := time.Now()
				mu.Lock()
				rep.Started = append(rep.Started, now.UnixNano())
				rep.Slots = append(rep.Slots, r.Booking().At.UnixMicro())
				rep.Called = append(rep.Called, called.UnixNano())
				rep.Waited = append(rep.Waited, int64(now.Sub(called)))
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if err := json.NewEncoder(os.Stdout).Encode(rep); err != nil {
		return 1
	}
	return 0
}

// TestSoak runs 8 OS processes of 25 workers each on one key at 50/s, every
// start recorded by the workers themselves: in any window W no more than
// burst+1+floor(W/interval) start, every confirmed booking starts, and once
// idle no key is left behind.
func TestSoak(t *testing.T) {
	srv := redistest.Shared(t)
	srv.RequireReal(t)
	self, err := os.Executable()
	require.NoError(t, err)
	prefix := redistest.Prefix(t)
	start := time.Now().Add(3 * time.Second) // every process up before then, even on a busy machine
	until := start.Add(*soakFor)

	reports := make([]soakReport, 8)
	var wg sync.WaitGroup
	for p := range reports {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cmd := exec.Command(self, "-test.run=^$")
			cmd.Env = append(os.Environ(), "SOAK_WORKER=1", "SOAK_ADDR="+srv.Addr, "SOAK_PREFIX="+prefix,
				"SOAK_START="+strconv.FormatInt(start.UnixNano(), 10), "SOAK_UNTIL="+strconv.FormatInt(until.UnixNano(), 10))
			var out, errb bytes.Buffer
			cmd.Stdout, cmd.Stderr = &out, &errb
			if err := cmd.Run(); err != nil {
				t.Errorf("process %d: %v: %s", p, err, errb.String())
				return
			}
			if err := json.Unmarshal(out.Bytes(), &reports[p]); err != nil {
				t.Errorf("process %d: %v: %q", p, err, out.String())
			}
		}()
	}
	wg.Wait()
	if t.Failed() {
		return
	}

	var started []time.Time
	var slots []time.Time
	var late time.Duration
	confirmed, refused := 0, 0
	for p, r := range reports {
		require.Empty(t, r.Errors, "process %d", p)
		require.Equal(t, r.Confirmed, len(r.Started), "process %d: every confirmed booking started", p)
		confirmed += r.Confirmed
		refused += r.Refused
		require.Len(t, r.Called, len(r.Started), "process %d", p)
		require.Len(t, r.Waited, len(r.Started), "process %d", p)
		for i := range r.Started {
			s, slot := time.Unix(0, r.Started[i]), time.UnixMicro(r.Slots[i])
			// The start is judged as a monotonic offset from the call
			// that booked it, against the slot's wall-clock offset from
			// that call, not as a wall-clock reading: Wait sleeps on the
			// monotonic clock (up to seconds here, 200 workers queued at
			// 50/s), which this VM's wall clock is slewed against
			// (hundreds of µs a second at times), and the slack is only
			// the reply's transit and the timer's lateness. A start
			// before its slot on the Redis clock is still caught.
			called := time.Unix(0, r.Called[i])
			require.GreaterOrEqual(t, time.Duration(r.Waited[i]), slot.Sub(called), "process %d started before its slot", p)
			late = max(late, s.Sub(slot))
			started = append(started, s)
			slots = append(slots, slot)
		}
	}
	t.Logf("%d processes: %d confirmed and started, %d refusals, latest start %v after its slot", len(reports), confirmed, refused, late)
	// The quota was used: on the Redis clock, from the first slot to the
	// last, the slots are back to back (judged on the slots, not on the
	// wall clock, so processes that a busy machine starts late cannot fail
	// it). A refusal while the queue is full would show as a gap.
	first, last := slots[0], slots[0]
	for _, s := range slots {
		first, last = minTime(first, s), maxTime(last, s)
	}
	dense := soakLimit.Burst + 1 + int(last.Sub(first)/soakLimit.Interval())
	t.Logf("slots span %v: %d booked, %d fit", last.Sub(first), confirmed, dense)
	require.GreaterOrEqual(t, confirmed, dense*98/100-2, "the quota was used between the first slot and the last (a busy machine may leave a worker late past the queue's depth now and then)")
	require.GreaterOrEqual(t, last.Sub(first), *soakFor/2, "the processes overlapped for most of the soak")
	require.NoError(t, limitcheck.Windows(slots, soakLimit, 0))
	require.NoError(t, limitcheck.Windows(started, soakLimit, late))

	// Once idle, every key goes: none is left without an expiry.
	ctx := context.Background()
	rdb := srv.Client(t)
	keys, err := rdb.Keys(ctx, prefix+"*").Result()
	require.NoError(t, err)
	for _, k := range keys {
		ttl, err := rdb.PTTL(ctx, k).Result()
		require.NoError(t, err)
		require.True(t, ttl > 0 || ttl == -2*time.Nanosecond, "key %s has no expiry (PTTL %v)", k, ttl)
	}
	require.Eventually(t, func() bool {
		n, err := rdb.Keys(ctx, prefix+"*").Result()
		return err == nil && len(n) == 0
	}, 5*time.Second, 50*time.Millisecond, "keys left once idle")
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}
