package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

func TestMain(m *testing.M) { redistest.Main(m) }

// fixture books, through reserve Limiters, a backlog of a different
// length for each of several subjects of "api" (two limits each), a
// subject of another limiter, and a refund's tombstone.
type fixture struct {
	url    string
	prefix string
	lim    *reserve.Limiter
	// booked per subject: how many slots were booked
	booked map[string]int
}

// first is the fixture's first limit: slow, so that a busy machine cannot
// drain a backlog mid-test.
var first = throttle.Every(10*time.Second, 1, 1)

func newFixture(t *testing.T, rdb redis.UniversalClient, url string, subjects map[string]int) *fixture {
	t.Helper()
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	lim, err := reserve.New(eng, "api", first, reserve.WithLimit(throttle.PerDay(1000, 10)))
	require.NoError(t, err)
	ctx := context.Background()
	for s, n := range subjects {
		for i := 0; i < n; i++ {
			r, err := lim.Reserve(ctx, s)
			require.NoError(t, err)
			require.True(t, r.OK())
		}
	}
	// A cancelled booking leaves a tombstone key beside the subject's:
	// "cancelled" keeps two bookings (the burst's, at once) and gives the
	// third, a second away, back.
	var r *reserve.Reservation
	for i := 0; i < 3; i++ {
		r, err = lim.Reserve(ctx, "cancelled")
		require.NoError(t, err)
	}
	require.NoError(t, r.Cancel(ctx))
	if c, ok := rdb.(*redis.Client); ok {
		tombs, err := c.Keys(ctx, prefix+"api:{cancelled}:x:*").Result() // KEYS: only in this test
		require.NoError(t, err)
		require.Len(t, tombs, 1, "the refund's tombstone")
	}
	other, err := reserve.New(eng, "apix", first)
	require.NoError(t, err)
	_, err = other.Reserve(ctx, "elsewhere")
	require.NoError(t, err)
	return &fixture{url: url, prefix: prefix, lim: lim, booked: subjects}
}

func (f *fixture) run(t *testing.T, args ...string) string {
	t.Helper()
	var out bytes.Buffer
	all := append([]string{"-redis", f.url, "-prefix", f.prefix}, args...)
	require.NoError(t, run(context.Background(), all, &out), "slotbook %v", all)
	return out.String()
}

// jsonFrame is a frame as its JSON reads back.
type jsonFrame struct {
	Subjects int `json:"subjects"`
	Top      []struct {
		Subject   string   `json:"subject"`
		Backlog   float64  `json:"backlog"`
		Wait      *float64 `json:"wait"`
		NextFree  string   `json:"next_free"`
		Available *int     `json:"available"`
		Keys      []struct {
			Key    string  `json:"key"`
			Period float64 `json:"period"`
			Exists bool    `json:"exists"`
			TAT    string  `json:"tat"`
			TTL    float64 `json:"ttl"`
		} `json:"keys"`
	} `json:"top"`
}

func (f *fixture) inspectJSON(t *testing.T, args ...string) jsonFrame {
	t.Helper()
	var fr jsonFrame
	out := f.run(t, append([]string{"-json"}, args...)...)
	require.NoError(t, json.Unmarshal([]byte(out), &fr), out)
	return fr
}

// TestInspect: every subject of the limiter, most backed up first, each
// with both limits' keys, the TATs the limiter's own State reads, and
// nothing of another limiter or a tombstone.
func TestInspect(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	srv.RequireReal(t)
	subjects := map[string]int{"small": 1, "big": 6, "mid": 4, "odd }:{x} *?[": 3}
	f := newFixture(t, srv.Client(t), "redis://"+srv.Addr, subjects)

	fr := f.inspectJSON(t, "inspect", "api")
	require.Equal(t, 5, fr.Subjects) // and "cancelled", idle in Redis terms but for its day key
	var order []string
	for _, s := range fr.Top {
		order = append(order, s.Subject)
	}
	require.Equal(t, []string{"big", "mid", "odd }:{x} *?[", "cancelled", "small"}, order)
	booked := map[string]int{"cancelled": 2}
	for s, n := range subjects {
		booked[s] = n
	}
	for _, s := range fr.Top {
		st, err := f.lim.State(context.Background(), s.Subject)
		require.NoError(t, err)
		require.Len(t, s.Keys, 2, s.Subject)
		for i, k := range s.Keys {
			require.Equal(t, f.prefix+st.Keys[i].Key, k.Key)
			require.True(t, k.Exists)
			require.Equal(t, st.Keys[i].TAT.Format(time.RFC3339Nano), mustTime(t, k.TAT).Format(time.RFC3339Nano), "%s: the stored TAT", k.Key)
			require.Positive(t, k.TTL)
		}
		require.Equal(t, (24 * time.Hour).Seconds(), s.Keys[1].Period)
		require.Nil(t, s.Wait, "no -limit: the wait is not known")
		// Backlog: the longest, the day limit's, booked intervals ahead.
		day := throttle.PerDay(1000, 10).Interval()
		require.InDelta(t, (time.Duration(booked[s.Subject]) * day).Seconds(), s.Backlog, 30.0, s.Subject)
	}

	// With -limit: the wait and next free slot a request would get now.
	// The backlogs are longer than the burst, so the next free slot is
	// TAT - tau, whenever it is read.
	fr = f.inspectJSON(t, "-limit", "1/10s:1", "-limit", "1000/24h:10", "-top", "2", "inspect", "api")
	require.Equal(t, 5, fr.Subjects)
	require.Len(t, fr.Top, 2)
	for _, s := range fr.Top {
		st, err := f.lim.State(context.Background(), s.Subject)
		require.NoError(t, err)
		require.NotNil(t, s.Wait)
		require.Equal(t, st.NextFree.Format(time.RFC3339Nano), mustTime(t, s.NextFree).Format(time.RFC3339Nano))
		require.Equal(t, 0, *s.Available)
	}

	// Subjects named on the command line, one of them idle.
	fr = f.inspectJSON(t, "inspect", "api", "small", "never-seen")
	require.Equal(t, 2, fr.Subjects)
	require.Equal(t, "small", fr.Top[0].Subject)
	require.Equal(t, "never-seen", fr.Top[1].Subject)
	require.Len(t, fr.Top[1].Keys, 1)
	require.False(t, fr.Top[1].Keys[0].Exists)

	text := f.run(t, "inspect", "api")
	require.Contains(t, text, "api: 5 subjects")
	for s := range subjects {
		require.Contains(t, text, fmt.Sprintf("%q", s))
	}
	require.NotContains(t, text, "elsewhere")
	require.NotContains(t, text, ":x:", "a tombstone is no subject's key")
}

func mustTime(t *testing.T, s string) time.Time {
	t.Helper()
	tm, err := time.Parse(time.RFC3339Nano, s)
	require.NoError(t, err)
	return tm
}

// TestReset clears one subject in every limit and leaves the others.
func TestReset(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	srv.RequireReal(t)
	f := newFixture(t, srv.Client(t), "redis://"+srv.Addr, map[string]int{"a": 3, "b": 3})
	out := f.run(t, "reset", "api", "a")
	require.Contains(t, out, `api "a": reset`)
	ctx := context.Background()
	st, err := f.lim.State(ctx, "a")
	require.NoError(t, err)
	for _, k := range st.Keys {
		require.False(t, k.Exists, k.Key)
	}
	st, err = f.lim.State(ctx, "b")
	require.NoError(t, err)
	for _, k := range st.Keys {
		require.True(t, k.Exists, k.Key)
	}
	// Resetting an idle subject is not an error.
	f.run(t, "-json", "reset", "api", "a")
}

// TestWatch prints -count readings, -interval apart, and stops early when
// its context ends.
func TestWatch(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	srv.RequireReal(t)
	f := newFixture(t, srv.Client(t), "redis://"+srv.Addr, map[string]int{"a": 3})
	out := f.run(t, "-json", "-count", "3", "-interval", "10ms", "watch", "api")
	dec := json.NewDecoder(strings.NewReader(out))
	n := 0
	for dec.More() {
		var fr jsonFrame
		require.NoError(t, dec.Decode(&fr))
		require.Equal(t, "a", fr.Top[0].Subject)
		n++
	}
	require.Equal(t, 3, n)

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	var buf syncBuffer
	go func() {
		done <- run(ctx, []string{"-redis", f.url, "-prefix", f.prefix, "-interval", "10ms", "watch", "api"}, &buf)
	}()
	require.Eventually(t, func() bool { return strings.Count(buf.String(), "api: 2 subjects") >= 2 }, 10*time.Second, 5*time.Millisecond)
	cancel()
	require.NoError(t, <-done)
}

// TestCluster: on a 3-master Redis Cluster, inspect finds the subjects on
// every master, and reset clears a subject on whichever holds it.
func TestCluster(t *testing.T) {
	t.Parallel()
	c := redistest.StartCluster(t, 3)
	cc := c.Client(t)
	subjects := map[string]int{}
	for i := 0; i < 30; i++ {
		subjects[fmt.Sprintf("s%02d", i)] = 1 + i%4
	}
	f := newFixture(t, cc, "redis://"+c.Addrs[1], subjects)
	// The subjects do live on more than one master.
	masters := map[string]bool{}
	for s := range subjects {
		addr, err := cc.MasterForKey(context.Background(), f.prefix+firstKey("api", s))
		require.NoError(t, err)
		masters[addr.Options().Addr] = true
	}
	require.Len(t, masters, 3)

	fr := f.inspectJSON(t, "-top", "0", "inspect", "api")
	require.Equal(t, len(subjects)+1, fr.Subjects) // and "cancelled"
	got := map[string]bool{}
	for _, s := range fr.Top {
		got[s.Subject] = true
	}
	for s := range subjects {
		require.True(t, got[s], s)
	}
	f.run(t, "reset", "api", "s03")
	st, err := f.lim.State(context.Background(), "s03")
	require.NoError(t, err)
	require.False(t, st.Keys[0].Exists)
	require.False(t, st.Keys[1].Exists)
}

// TestUsage: bad command lines are errors before any Redis call (the URL
// points nowhere).
func TestUsage(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{
		{},
		{"inspect"},
		{"frobnicate", "api"},
		{"reset", "api"},
		{"watch", "api", "extra"},
		{"inspect", "a:b"},
		{"-limit", "10", "inspect", "api"},
		{"-limit", "0/1s", "inspect", "api"},
		{"-limit", "10/1s:x", "inspect", "api"},
		{"-interval", "0s", "watch", "api"},
		{"-count", "-1", "watch", "api"},
		{"-nosuchflag", "inspect", "api"},
		// reserve's rules: no two limits of one period, a further limit's
		// period in whole milliseconds, a subject with a hash tag.
		{"-limit", "10/1s", "-limit", "20/1s", "inspect", "api"},
		{"-limit", "10/1s", "-limit", "100/1m", "-limit", "50/60s", "inspect", "api"},
		{"-limit", "10/1s", "-limit", "10/1500us", "inspect", "api"},
		{"inspect", "api", "}"},
		{"reset", "api", ""},
		// a flag after the command is no subject
		{"inspect", "api", "-json"},
		{"inspect", "api", "a", "--top=3"},
		{"reset", "api", "-json"},
		{"watch", "api", "-count", "2"},
	} {
		err := run(context.Background(), append([]string{"-redis", "redis://127.0.0.1:1"}, args...), &bytes.Buffer{})
		require.ErrorIs(t, err, errUsage, "%v", args)
	}
}

func TestParseKey(t *testing.T) {
	t.Parallel()
	tests := []struct {
		key     string
		subject string
		period  time.Duration
		v1      bool
		ok      bool
	}{
		{"p:api:{t}", "t", 0, false, true},
		{"p:api:{t}:86400000ms", "t", 24 * time.Hour, false, true},
		{"p:api:{t}:500ms", "t", 500 * time.Millisecond, false, true}, // both layouts' name
		{"p:api:{t}:24h0m0s", "t", 24 * time.Hour, true, true},
		{"p:api:{t}:10s", "t", 10 * time.Second, true, true},
		{"p:api:{t}:1.5ms", "t", 1500 * time.Microsecond, true, true},
		{"p:api:{a}:b}", "a}:b", 0, false, true},
		{"p:api:{a}:b}:1m0s", "a}:b", time.Minute, true, true},
		{"p:api:{a}:b}:60000ms", "a}:b", time.Minute, false, true},
		{"p:api:{t}:1000", "", 0, false, false}, // neither layout
		{"p:api:{t}:24h", "", 0, false, false},  // not Duration.String's form
		{"p:api:{t}:060000ms", "", 0, false, false},
		{"p:api:{t}:+5ms", "", 0, false, false},
		{"p:api:{t}:-5ms", "", 0, false, false},
		{"p:api:{t}:x:3k2j", "", 0, false, false},
		{"p:api:{t}:-1s", "", 0, false, false},
		{"p:api:{t}:0ms", "", 0, false, false},
		{"p:apix:{t}", "", 0, false, false},
		{"p:api:t", "", 0, false, false},
		{"q:api:{t}", "", 0, false, false},
	}
	for _, tc := range tests {
		s, p, v1, ok := parseKey(tc.key, "p:", "api")
		require.Equal(t, tc.ok, ok, tc.key)
		require.Equal(t, tc.subject, s, tc.key)
		require.Equal(t, tc.period, p, tc.key)
		require.Equal(t, tc.v1, v1, tc.key)
	}
}

// TestGlobEscape: SCAN's special characters are escaped, and bytes that
// are not UTF-8 pass as they are (not as U+FFFD).
func TestGlobEscape(t *testing.T) {
	t.Parallel()
	require.Equal(t, `p\*:api:{a\?\[b\]\\c\^\-d}`, globEscape(`p*:api:{a?[b]\c^-d}`))
	require.Equal(t, "bin\xff\xfe\\*", globEscape("bin\xff\xfe*"))
}

type syncBuffer struct {
	mu  sync.Mutex // guards buf
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
