package throttle

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestBook1ValsReadsEveryForm: book1Vals reads each form of book1.lua's
// reply (docs/PROTOCOL.md) into {now, tat, w, end}, the wait worked out
// by hand here from the definition, and refuses a reply that is not one
// of them or that disagrees with the request's max wait.
func TestBook1ValsReadsEveryForm(t *testing.T) {
	l := PerSecond(10, 5) // I = 100000 µs, tau = 500000 µs
	const now = 1767225600123456
	for _, c := range []struct {
		reply   string
		r       Request
		want    []int64
		invalid bool
	}{
		{reply: "1767225600 123456", r: Request{N: 1}, want: []int64{now, now, 0, 0}},
		// stored now+6I: wait = now+600000 - 500000 - now = 100000
		{reply: "1767225600 123456 1767225600723456", r: Request{N: 1, MaxWait: 100 * time.Millisecond},
			want: []int64{now, now + 600000, 100000, 0}},
		{reply: "1767225600 123456 -1767225600723456", r: Request{N: 1}, want: []int64{now, now + 600000, -100001, 0}},
		// n = 6 (burst+1) on now+I: wait = now+100000 + 500000 - 500000 - now = 100000
		{reply: "1767225600 123456 -1767225600223456", r: Request{N: 6}, want: []int64{now, now + 100000, -100001, 0}},
		// An explicit (test) clock: "0 <now>".
		{reply: "0 1767225600123456", r: Request{N: 1}, want: []int64{now, now, 0, 0}},
		// A microsecond field without leading zeros.
		{reply: "1767225600 5", r: Request{N: 1}, want: []int64{1767225600000005, 1767225600000005, 0, 0}},

		{reply: "1767225600", invalid: true},
		{reply: "1767225600 123456 ", invalid: true},
		{reply: "1767225600 x", invalid: true},
		{reply: "1767225600 123456 -", r: Request{N: 1}, invalid: true},                 // idle, wait 0: not a refusal
		{reply: "1767225600 123456 1767225600723456", r: Request{N: 1}, invalid: true},  // wait 100000 > max wait 0, yet booked
		{reply: "1767225600 123456 -1767225600123457", r: Request{N: 1}, invalid: true}, // wait 0, yet refused
		{reply: "1767225600 123456 1767225600123456", r: Request{N: 1}, invalid: true},  // a TAT not ahead is not sent
		{reply: "-5 123456", r: Request{N: 1}, invalid: true},
	} {
		got, err := book1Vals(c.reply, l, c.r)
		if c.invalid {
			require.Error(t, err, "%q", c.reply)
			continue
		}
		require.NoError(t, err, "%q", c.reply)
		require.Equal(t, c.want, got, "%q", c.reply)
	}
	_, err := book1Vals([]any{int64(1), int64(2), int64(0)}, l, Request{N: 1})
	require.ErrorContains(t, err, "want a string", "the array of protocol 2's first form")
}
