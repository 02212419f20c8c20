package throttle

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestBook1ValsReadsEveryForm: readBook1 and judge read each form of
// book1.lua's reply (docs/PROTOCOL.md) into a Booking, the wait worked
// out by hand here from the definition, and refuse a reply that is not
// one of them or that disagrees with the request's max wait.
func TestBook1ValsReadsEveryForm(t *testing.T) {
	l := PerSecond(10, 5) // I = 100000 µs, tau = 500000 µs
	const now = 1767225600123456
	for _, c := range []struct {
		reply   string
		r       Request
		booked  bool
		wait    int64 // µs
		tat     int64 // judged against
		invalid bool
	}{
		{reply: "1767225600 123456", r: Request{N: 1}, booked: true, tat: now},
		// stored now+6I: wait = now+600000 - 500000 - now = 100000
		{reply: "1767225600 123456 1767225600723456", r: Request{N: 1, MaxWait: 100 * time.Millisecond},
			booked: true, wait: 100000, tat: now + 600000},
		{reply: "1767225600 123456 -1767225600723456", r: Request{N: 1}, wait: 100000, tat: now + 600000},
		// n = 6 (burst+1) on now+I: wait = now+100000 + 500000 - 500000 - now = 100000
		{reply: "1767225600 123456 -1767225600223456", r: Request{N: 6}, wait: 100000, tat: now + 100000},
		// An explicit (test) clock: "0 <now>".
		{reply: "0 1767225600123456", r: Request{N: 1}, booked: true, tat: now},
		// A microsecond field without leading zeros.
		{reply: "1767225600 5", r: Request{N: 1}, booked: true, tat: 1767225600000005},

		{reply: "1767225600", invalid: true},
		{reply: "1767225600 123456 ", invalid: true},
		{reply: "1767225600 x", invalid: true},
		{reply: "1767225600 123456 -", r: Request{N: 1}, invalid: true},                 // idle, wait 0: not a refusal
		{reply: "1767225600 123456 1767225600723456", r: Request{N: 1}, invalid: true},  // wait 100000 > max wait 0, yet booked
		{reply: "1767225600 123456 -1767225600123457", r: Request{N: 1}, invalid: true}, // wait 0, yet refused
		{reply: "1767225600 123456 1767225600123456", r: Request{N: 1}, invalid: true},  // a TAT not ahead is not sent
		{reply: "-5 123456", r: Request{N: 1}, invalid: true},
	} {
		vals := make([]int64, 4)
		err := readBook1(c.reply, vals)
		var bs []Booking
		if err == nil {
			bs, err = judge(vals, []Limit{l}, []Request{c.r}, nil)
		}
		if c.invalid {
			require.Error(t, err, "%q", c.reply)
			continue
		}
		require.NoError(t, err, "%q", c.reply)
		require.Len(t, bs, 1)
		b := bs[0]
		require.Equal(t, c.booked, b.OK, "%q booked", c.reply)
		require.Equal(t, time.Duration(c.wait)*time.Microsecond, b.Wait, "%q wait", c.reply)
		require.Equal(t, time.UnixMicro(vals[0]+c.wait), b.At, "%q slot", c.reply)
		require.Equal(t, []int64{c.tat}, b.starts, "%q judged against", c.reply)
		if c.booked {
			require.Equal(t, []int64{max(c.tat, vals[0]+c.wait) + int64(c.r.N)*100000}, b.ends, "%q end", c.reply)
		}
	}
	err := readBook1([]any{int64(1), int64(2), int64(0)}, make([]int64, 4))
	require.ErrorContains(t, err, "want a string", "the array of protocol 2's first form")
}

// TestJudgeReadsRuns: judge reads book.lua's reply, {now, tat_1 .. tat_m,
// then per run of requests alike: how many were booked}, into each
// request's Booking, worked out here by hand, and refuses a count that
// disagrees with the requests' max waits or exceeds its run.
func TestJudgeReadsRuns(t *testing.T) {
	l := PerSecond(10, 5) // I = 100000 µs, tau = 500000 µs
	const now = 1767225600000000
	// Stored now+4I. Runs: 3 x (n 1, W 0), then (n 2, W 200000).
	// r1 wait 0, leaves now+5I; r2 wait 0, leaves now+6I; r3 wait 100000 >
	// 0: refused; r4 wait now+6I + I - tau - now = 200000: booked, leaves
	// now+8I.
	reqs := []Request{{N: 1}, {N: 1}, {N: 1}, {N: 2, MaxWait: 200 * time.Millisecond}}
	vals := func(booked ...int64) []int64 {
		return append(append([]int64{now, now + 400000}, booked...), make([]int64, len(reqs))...)
	}
	bs, err := judge(vals(2, 1), []Limit{l}, reqs, nil)
	require.NoError(t, err)
	want := []struct {
		ok         bool
		wait       int64
		start, end int64
	}{
		{true, 0, now + 400000, now + 500000},
		{true, 0, now + 500000, now + 600000},
		{false, 100000, now + 600000, now + 600000},
		{true, 200000, now + 600000, now + 800000},
	}
	for i, w := range want {
		b := bs[i]
		require.Equal(t, w.ok, b.OK, "request %d booked", i)
		require.Equal(t, time.Duration(w.wait)*time.Microsecond, b.Wait, "request %d wait", i)
		require.Equal(t, []int64{w.start}, b.starts, "request %d judged against", i)
		require.Equal(t, []int64{w.end}, b.ends, "request %d end", i)
	}
	for _, bad := range [][]int64{
		{3, 1}, // r3 (wait 100000 > 0) booked
		{1, 1}, // r2 (wait 0) refused
		{2, 0}, // r4 (wait 200000 = max wait) refused
		{2, 2}, // more booked than the run holds
		{4, 1}, // the same, in the first run
	} {
		_, err := judge(vals(bad...), []Limit{l}, reqs, nil)
		require.Error(t, err, "%v", bad)
	}
}
