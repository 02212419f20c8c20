package httplimit

import (
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestPauseFor: Retry-After in both forms, the reset headers only when
// asked for, and every value capped at the max pause, including ones too
// large for any integer (which would overflow a Duration).
func TestPauseFor(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	const maxPause = time.Hour
	tests := []struct {
		name   string
		header http.Header
		reset  bool
		want   time.Duration
		ok     bool
	}{
		{"seconds", http.Header{"Retry-After": {"3"}}, false, 3 * time.Second, true},
		{"zero", http.Header{"Retry-After": {"0"}}, false, 0, true},
		{"spaces", http.Header{"Retry-After": {" 2 "}}, false, 2 * time.Second, true},
		{"date", http.Header{"Retry-After": {"Wed, 02 Dec 2026 12:00:10 GMT"}}, false, 10 * time.Second, true},
		{"past date", http.Header{"Retry-After": {"Wed, 02 Dec 2026 11:59:00 GMT"}}, false, 0, true},
		{"far date", http.Header{"Retry-After": {"Fri, 31 Dec 9999 23:59:59 GMT"}}, false, maxPause, true},
		{"huge", http.Header{"Retry-After": {"5000000000"}}, false, maxPause, true},
		{"overflows Duration", http.Header{"Retry-After": {"9300000000"}}, false, maxPause, true},
		{"overflows uint64", http.Header{"Retry-After": {"99999999999999999999999"}}, false, maxPause, true},
		{"just over", http.Header{"Retry-After": {"3601"}}, false, maxPause, true},
		{"negative", http.Header{"Retry-After": {"-1"}}, false, 0, false},
		{"fraction", http.Header{"Retry-After": {"1.5"}}, false, 0, false},
		{"garbage", http.Header{"Retry-After": {"soon"}}, false, 0, false},
		{"none", http.Header{}, true, 0, false},
		{"reset header ignored by default", http.Header{"Ratelimit-Reset": {"7"}}, false, 0, false},
		{"RateLimit-Reset", http.Header{"Ratelimit-Reset": {"7"}}, true, 7 * time.Second, true},
		{"X-RateLimit-Reset seconds", http.Header{"X-Ratelimit-Reset": {"9"}}, true, 9 * time.Second, true},
		{"X-RateLimit-Reset Unix time", http.Header{"X-Ratelimit-Reset": {"1796212830"}}, true, 30 * time.Second, true},
		{"X-RateLimit-Reset Unix time passed", http.Header{"X-Ratelimit-Reset": {"1796212000"}}, true, 0, true},
		{"X-RateLimit-Reset huge", http.Header{"X-Ratelimit-Reset": {"99999999999999999999999"}}, true, maxPause, true},
		{"Retry-After first", http.Header{"Retry-After": {"1"}, "Ratelimit-Reset": {"7"}}, true, time.Second, true},
	}
	// 1796212800 is 2026-12-02 12:00:00 UTC.
	require.Equal(t, int64(1796212800), now.Unix())
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tr := &Transport{maxPause: maxPause, resetHeaders: tc.reset}
			got, ok := tr.pauseFor(tc.header, now)
			require.Equal(t, tc.ok, ok)
			require.Equal(t, tc.want, got)
		})
	}
}
