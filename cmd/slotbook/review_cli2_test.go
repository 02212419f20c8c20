package main

// Second adversarial review of the operator CLI: the fixes of 9c29e38..c73c1a2.
// Oracles: the GCRA definition (docs/PROTOCOL.md) applied to the stored
// TATs read directly from Redis on the Redis clock (rvEnv.oracle of
// review_cli_test.go), and the library's own reserve.Limiter.State.

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// cl2Frame is a -json frame with every field the fixes added.
type cl2Frame struct {
	Name     string `json:"name"`
	Subjects int    `json:"subjects"`
	Top      []struct {
		Subject       string   `json:"subject"`
		SubjectBase64 string   `json:"subject_base64"`
		Backlog       float64  `json:"backlog"`
		Wait          *float64 `json:"wait"`
		NextFree      string   `json:"next_free"`
		Available     *int     `json:"available"`
		Error         string   `json:"error"`
		Keys          []struct {
			Key       string  `json:"key"`
			KeyBase64 string  `json:"key_base64"`
			Period    float64 `json:"period"`
			Protocol1 bool    `json:"protocol1"`
			Exists    bool    `json:"exists"`
			TAT       string  `json:"tat"`
		} `json:"keys"`
	} `json:"top"`
}

// cl2Run runs the command against e's Redis and prefix, returning output and error.
func (e *rvEnv) cl2Run(args ...string) (string, error) {
	var out bytes.Buffer
	all := append([]string{"-redis", e.url, "-prefix", e.prefix}, args...)
	err := run(context.Background(), all, &out)
	return out.String(), err
}

func cl2Decode(t *testing.T, out string) cl2Frame {
	t.Helper()
	var fr cl2Frame
	require.NoError(t, json.Unmarshal([]byte(out), &fr), out)
	return fr
}

// cl2Set stores val under key (full key) for two minutes.
func (e *rvEnv) cl2Set(t *testing.T, key, val string) {
	t.Helper()
	require.NoError(t, e.rdb.Set(context.Background(), key, val, 2*time.Minute).Err())
}

// ---------------------------------------------------------------------------
// FINDINGS (expected to fail on the current code)

// FINDING (fixed): naming a subject twice, or two subjects whose SCAN
// patterns overlap ("a" matches "a}"'s keys), when the subject has a
// protocol-1 key: the key was collected once per pattern, the second
// State call got it twice ("key given twice", ErrInvalidRequest) and the
// healthy subject was reported unreadable ("reset clears a corrupt
// subject"), exit code 1. Keys found, and subjects named, now count once.
func TestReviewCL2DuplicateProtocol1Key(t *testing.T) {
	t.Parallel()
	e := rvNewEnv(t, "")
	lim := e.limiter(t, "api", throttle.Every(time.Second, 1, 0), throttle.Every(10*time.Second, 1, 0))
	now := e.redisNow(t)
	for _, s := range []string{"s", "a}"} {
		e.book(t, lim, s, 1)
		e.cl2Set(t, e.prefix+"api:{"+s+"}:10s", strconv.FormatInt(now+60_000_000, 10))
	}
	e.book(t, lim, "a", 1)

	for _, args := range [][]string{
		{"inspect", "api", "s", "s"},
		{"inspect", "api", "a", "a}"},
	} {
		out, err := e.cl2Run(append([]string{"-json"}, args...)...)
		if !assert.NoError(t, err, "%q: a healthy subject reported unreadable\n%s", args, out) {
			continue
		}
		fr := cl2Decode(t, out)
		for _, s := range fr.Top {
			assert.Empty(t, s.Error, "%q: subject %q", args, s.Subject)
		}
	}
}

// FINDING (fixed): a key that holds a value of the wrong type (a list
// where a TAT belongs: a value that is not a TAT) hid every other
// subject: the WRONGTYPE reply is not ErrCorruptState, so read ended with
// an error and nothing was printed, although reset clears it (DEL). It is
// now listed as unreadable, as a corrupt value is.
func TestReviewCL2WrongTypeHidesListing(t *testing.T) {
	t.Parallel()
	e := rvNewEnv(t, "")
	lim := e.limiter(t, "api", throttle.Every(10*time.Second, 1, 1))
	e.book(t, lim, "good", 2)
	require.NoError(t, e.rdb.RPush(context.Background(), e.prefix+"api:{bad}", "x").Err())
	t.Cleanup(func() { e.rdb.Del(context.Background(), e.prefix+"api:{bad}") })

	out, err := e.cl2Run("inspect", "api")
	t.Logf("inspect with a list under a subject key: err=%v\n%s", err, out)
	require.Error(t, err)
	require.False(t, errors.Is(err, errUsage))
	require.Contains(t, out, `"good"`, "the others are listed (as for a corrupt string value)")
	require.Contains(t, out, `"bad" unreadable`)

	// reset does clear it, then inspect succeeds.
	_, err = e.cl2Run("reset", "api", "bad")
	require.NoError(t, err)
	_, err = e.cl2Run("inspect", "api")
	require.NoError(t, err)
}

// FINDING (fixed): a subject with more live keys than one State call
// takes (MaxLimits = 8: keys left by two configurations of the limiter,
// each valid on its own) was listed as unreadable, "reset clears a corrupt
// subject", exit 1, although nothing is corrupt and both configurations'
// limiters read it. Protocol-1 keys were read in chunks of MaxLimits;
// live keys now are too.
func TestReviewCL2ManyLiveKeysUnreadable(t *testing.T) {
	t.Parallel()
	e := rvNewEnv(t, "")
	first := throttle.Every(time.Minute, 1, 0)
	var a, b []throttle.Limit
	for i := 0; i < 7; i++ {
		a = append(a, throttle.Every(time.Duration(2+i)*time.Minute, 1, 0))
		b = append(b, throttle.Every(time.Duration(20+i)*time.Minute, 1, 0))
	}
	la, lb := e.limiter(t, "api", first, a...), e.limiter(t, "api", first, b...)
	e.book(t, la, "s", 1)
	e.book(t, lb, "s", 1)
	for _, l := range []*reserve.Limiter{la, lb} {
		_, err := l.State(context.Background(), "s")
		require.NoError(t, err, "control: the library reads the subject")
	}
	out, err := e.cl2Run("-json", "inspect", "api")
	t.Logf("inspect: err=%v\n%s", err, out)
	require.NoError(t, err, "a subject with 15 healthy keys is reported unreadable")
	fr := cl2Decode(t, out)
	require.Len(t, fr.Top, 1)
	require.Empty(t, fr.Top[0].Error)
	require.Len(t, fr.Top[0].Keys, 15)
}

// FINDING (fixed, minor): a limiter name that is not valid UTF-8 (which
// reserve.New accepts) lost its bytes in reset -json: the reset keys were
// printed with U+FFFD and reset_base64 was only given when the SUBJECT is
// not UTF-8. (The frame's "name" of inspect -json had no base64 form
// either.) Now reset_base64 is given whenever a key is not UTF-8, and
// frames and reset carry name_base64.
func TestReviewCL2NonUTF8NameResetJSON(t *testing.T) {
	t.Parallel()
	e := rvNewEnv(t, "")
	name := "n\xff"
	lim := e.limiter(t, name, throttle.Every(10*time.Second, 1, 0))
	e.book(t, lim, "s", 1)
	out, err := e.cl2Run("-json", "reset", name, "s")
	require.NoError(t, err)
	var res struct {
		Reset       []string `json:"reset"`
		ResetBase64 []string `json:"reset_base64"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &res), out)
	_, ok := e.tatOf(t, e.prefix+name+":{s}")
	require.False(t, ok, "reset happened")
	exact := res.Reset
	if len(res.ResetBase64) > 0 {
		exact = nil
		for _, b := range res.ResetBase64 {
			exact = append(exact, string(rvBase64(t, b)))
		}
	}
	require.Equal(t, []string{name + ":{s}"}, exact, "reset -json must carry the exact key bytes: %s", out)
}

// JUDGEMENT (fixed): watch ended on the first frame that a slow Redis
// timed out (-timeout 300ms, one second of latency), with an error,
// instead of reporting and going on with the next refresh as it does for
// an unreadable subject: a watch left on a dashboard died on one blip.
// Now the failed frame is printed as its error and watch reads again at
// the next interval.
func TestReviewCL2WatchSurvivesSlowFrame(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	srv.RequireReal(t)
	p := redistest.NewProxy(t, srv.Addr)
	prefix := redistest.Prefix(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var buf syncBuffer
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"-redis", "redis://" + p.Addr(), "-prefix", prefix, "-json",
			"-timeout", "300ms", "-interval", "50ms", "watch", "api"}, &buf)
	}()
	frames := func() int { return strings.Count(buf.String(), "\n") }
	require.Eventually(t, func() bool { return frames() >= 2 }, 10*time.Second, 5*time.Millisecond)
	p.SetLatency(time.Second)
	time.Sleep(700 * time.Millisecond)
	p.SetLatency(0)
	p.Sever() // drop the connections holding delayed bytes
	n := frames()
	select {
	case err := <-done:
		t.Fatalf("watch ended after one slow frame (%d frames printed): %v", n, err)
	case <-time.After(5 * time.Second):
	}
	require.Greater(t, frames(), n, "watch refreshes again once Redis is back")
	cancel()
	require.NoError(t, <-done)
}

// ---------------------------------------------------------------------------
// SIDE PATHS (pass)

// TestReviewCL2Oracle: WAIT, NEXT FREE, AVAILABLE, BACKLOG of layered
// limits with bursts, a first limit whose period is not whole ms
// (allowed: its key has no suffix) and a further one of 1500 ms, against
// the definition and the library's State; subjects in several states
// (backed up, within burst, idle first key, named but absent).
func TestReviewCL2Oracle(t *testing.T) {
	t.Parallel()
	e := rvNewEnv(t, "")
	first := throttle.Every(2500500*time.Microsecond, 1, 2) // I = 2.5005 s, tau = 5.001 s
	mid := throttle.Every(1500*time.Millisecond, 1, 3)
	hour := throttle.Every(time.Hour, 60, 4) // I = 60 s
	limits := []throttle.Limit{first, mid, hour}
	lim := e.limiter(t, "api", first, mid, hour)
	e.book(t, lim, "busy", 9)
	e.book(t, lim, "two", 2)
	e.book(t, lim, "one", 1)
	// only the hour key: the first and mid keys deleted (expired, as it were)
	e.book(t, lim, "houronly", 3)
	require.NoError(t, e.rdb.Del(context.Background(), rvKeys(e.prefix, "api", "houronly", limits)[:2]...).Err())

	lf := []string{"-limit", "1/2500500us:2", "-limit", "1/1500ms:3", "-limit", "60/1h:4", "-top", "0"}
	t0 := e.redisNow(t)
	out, err := e.cl2Run(append(lf, "-json", "inspect", "api", "busy", "two", "one", "houronly", "absent")...)
	t1 := e.redisNow(t)
	require.NoError(t, err, out)
	fr := cl2Decode(t, out)
	require.Equal(t, 5, fr.Subjects)
	for _, s := range fr.Top {
		keys := rvKeys(e.prefix, "api", s.Subject, limits)
		o0, o1 := e.oracle(t, keys, limits, t0), e.oracle(t, keys, limits, t1)
		require.NotNil(t, s.Wait, s.Subject)
		require.NotNil(t, s.Available, s.Subject)
		nf := mustParseTime(t, s.NextFree).UnixMicro()
		require.GreaterOrEqual(t, nf, o0.slot, s.Subject)
		require.LessOrEqual(t, nf, o1.slot, s.Subject)
		if o0.slot > t1 {
			require.Equal(t, o0.slot, nf, "%s: next free", s.Subject)
		} else {
			require.Zero(t, *s.Wait, s.Subject)
		}
		require.GreaterOrEqual(t, *s.Available, min(o0.available, o1.available), s.Subject)
		require.LessOrEqual(t, *s.Available, max(o0.available, o1.available), s.Subject)
		st, err := lim.State(context.Background(), s.Subject)
		require.NoError(t, err)
		if o0.available == o1.available {
			require.Equal(t, st.Available, *s.Available, "%s: vs Limiter.State", s.Subject)
		}
		require.Len(t, s.Keys, 3, s.Subject)
		for i, k := range s.Keys {
			require.Equal(t, keys[i], k.Key, s.Subject)
		}
		t.Logf("%s: wait %v available %d (oracle slot-t0 %v, avail %d/%d)", s.Subject, *s.Wait, *s.Available,
			time.Duration(o0.slot-t0)*time.Microsecond, o0.available, o1.available)
	}
	// absent subject: idle everywhere: burst+1 of the smallest burst.
	for _, s := range fr.Top {
		if s.Subject == "absent" {
			require.Equal(t, 3, *s.Available)
		}
	}
	// A further limit whose period is not whole ms is a usage error.
	_, err = e.cl2Run("-limit", "1/1s", "-limit", "1/1500us", "inspect", "api")
	require.ErrorIs(t, err, errUsage)
	_, err = e.cl2Run("-limit", "1/1s", "-limit", "2/1s", "inspect", "api")
	require.ErrorIs(t, err, errUsage, "two limits of one period")
}

// TestReviewCL2DashDash: "--" and flag-like arguments after the command.
func TestReviewCL2DashDash(t *testing.T) {
	t.Parallel()
	e := rvNewEnv(t, "")
	lim := e.limiter(t, "api", throttle.Every(10*time.Second, 1, 1))
	for _, s := range []string{"--", "-5", "-", "-json", "x"} {
		e.book(t, lim, s, 1)
	}
	subjectsOf := func(args ...string) []string {
		t.Helper()
		out, err := e.cl2Run(append([]string{"-json"}, args...)...)
		require.NoError(t, err, "%q", args)
		var got []string
		for _, s := range cl2Decode(t, out).Top {
			got = append(got, s.Subject)
		}
		return got
	}
	require.Equal(t, []string{"--"}, subjectsOf("inspect", "api", "--", "--"))
	require.Equal(t, []string{"--"}, subjectsOf("inspect", "api", "--", "--", "--"))
	require.Len(t, subjectsOf("inspect", "api", "--"), 5, "a lone -- after the name: every subject")
	require.Equal(t, []string{"-5"}, subjectsOf("inspect", "api", "-5"), "a negative number names no flag")
	require.Equal(t, []string{"-"}, subjectsOf("inspect", "api", "-"))
	require.ElementsMatch(t, []string{"x", "-json"}, subjectsOf("inspect", "api", "x", "--", "-json"))
	require.Equal(t, []string{"-json"}, subjectsOf("inspect", "--", "api", "-json"), "-- before the name")
	for _, args := range [][]string{
		{"inspect", "api", "-json", "--", "x"},
		{"inspect", "api", "x", "-top=3"},
		{"inspect", "api", "--json"},
		{"inspect", "api", "-limit", "1/1s"},
		{"--", "inspect", "api", "-json"},
		{"reset", "api", "--"},
		{"reset", "api", "--", "a", "b"},
		{"watch", "api", "--", "x"},
	} {
		_, err := e.cl2Run(args...)
		require.ErrorIs(t, err, errUsage, "%q", args)
	}
	out, err := e.cl2Run("-count", "1", "watch", "api", "--")
	require.NoError(t, err)
	require.Contains(t, out, "5 subjects")
	_, err = e.cl2Run("reset", "api", "--", "--")
	require.NoError(t, err)
	_, ok := e.tatOf(t, keys0(e.prefix, "--"))
	require.False(t, ok)
	_, ok = e.tatOf(t, keys0(e.prefix, "-5"))
	require.True(t, ok)
	// flagName
	for a, want := range map[string]string{"-": "", "--": "", "-5": "5", "--top=3": "top", "-json=": "json", "x": "", "---json": "-json"} {
		require.Equal(t, want, flagName(a), a)
	}
}

// TestReviewCL2Protocol1Detection: which suffixes are read as live
// (protocol 2), which as protocol 1, which are ignored; reset deletes
// the live and the protocol-1 keys of the subject alone, in chunks.
func TestReviewCL2Protocol1Detection(t *testing.T) {
	t.Parallel()
	e := rvNewEnv(t, "")
	now := e.redisNow(t)
	tat := strconv.FormatInt(now+30_000_000, 10)
	base := e.prefix + "api:{s}"
	live := []string{"", ":1000ms", ":500ms", ":60000ms"}                                         // 500ms: protocol 1 and 2 alike
	old := []string{":1s", ":1m0s", ":1.5s", ":500µs", ":2h0m0s", ":1h1m1s", ":3s", ":4s", ":5s"} // 9: two chunks
	ignored := []string{":60s", ":01000ms", ":x:abc", ":1000", ":-1s", ":0s", ":1h"}
	for _, sfx := range append(append(append([]string{}, live...), old...), ignored...) {
		e.cl2Set(t, base+sfx, tat)
	}
	e.cl2Set(t, e.prefix+"api:{s}}:1s", tat) // subject "s}"'s protocol-1 key
	for _, sfx := range []string{"", ":1000ms", ":1s"} {
		e.cl2Set(t, e.prefix+"api:{s}:1000ms}"+sfx, tat) // subject "s}:1000ms"
	}

	out, err := e.cl2Run("-json", "inspect", "api", "s")
	require.NoError(t, err, out)
	fr := cl2Decode(t, out)
	require.Len(t, fr.Top, 1)
	got := map[string]bool{}
	for _, k := range fr.Top[0].Keys {
		got[strings.TrimPrefix(k.Key, base)] = k.Protocol1
		require.True(t, k.Exists, k.Key)
	}
	want := map[string]bool{}
	for _, s := range live {
		want[s] = false
	}
	for _, s := range old {
		want[s] = true
	}
	require.Equal(t, want, got)
	// Backlog counts live keys only (all hold the same TAT here); the
	// protocol-1 key of a later TAT does not raise it.
	e.cl2Set(t, base+":2h0m0s", strconv.FormatInt(now+3_600_000_000, 10))
	fr = cl2Decode(t, func() string { o, err := e.cl2Run("-json", "inspect", "api", "s"); require.NoError(t, err); return o }())
	require.Less(t, fr.Top[0].Backlog, 31.0)

	// The listing: three subjects.
	fr = cl2Decode(t, func() string { o, err := e.cl2Run("-json", "inspect", "api"); require.NoError(t, err); return o }())
	var subs []string
	for _, s := range fr.Top {
		subs = append(subs, s.Subject)
	}
	require.ElementsMatch(t, []string{"s", "s}", "s}:1000ms"}, subs)

	_, err = e.cl2Run("reset", "api", "s")
	require.NoError(t, err)
	for _, sfx := range append(append([]string{}, live...), old...) {
		_, ok := e.tatOf(t, base+sfx)
		require.False(t, ok, sfx)
	}
	for _, sfx := range ignored {
		_, err := e.rdb.Get(context.Background(), base+sfx).Result()
		require.NoError(t, err, "%s is no key of s: kept", sfx)
	}
	_, ok := e.tatOf(t, e.prefix+"api:{s}}:1s")
	require.True(t, ok)
	_, ok = e.tatOf(t, e.prefix+"api:{s}:1000ms}:1s")
	require.True(t, ok)
}

// TestReviewCL2UnreadableJSONWatch: a corrupt subject under -json, -top 1
// and watch: each frame is valid JSON, the unreadable one first with its
// error and base64 when its name is not UTF-8; inspect exits 1 (not a
// usage error), watch goes on and returns nil.
func TestReviewCL2UnreadableJSONWatch(t *testing.T) {
	t.Parallel()
	e := rvNewEnv(t, "")
	lim := e.limiter(t, "api", throttle.Every(10*time.Second, 1, 1))
	e.book(t, lim, "good", 3)
	e.cl2Set(t, e.prefix+"api:{b\xffd}", "12x")
	e.cl2Set(t, e.prefix+"api:{far}", strconv.FormatInt(e.redisNow(t)+400*24*3600*1_000_000, 10)) // beyond H+2(tau+I)

	out, err := e.cl2Run("-json", "-top", "1", "-limit", "1/10s:1", "inspect", "api")
	require.Error(t, err)
	require.False(t, errors.Is(err, errUsage))
	require.Contains(t, err.Error(), "2 of 3 subjects unreadable")
	fr := cl2Decode(t, out)
	require.Equal(t, 3, fr.Subjects)
	require.Len(t, fr.Top, 1)
	require.NotEmpty(t, fr.Top[0].Error)

	out, err = e.cl2Run("-json", "-top", "0", "-limit", "1/10s:1", "inspect", "api")
	require.Error(t, err)
	fr = cl2Decode(t, out)
	require.Len(t, fr.Top, 3)
	bad := map[string]string{}
	for _, s := range fr.Top[:2] {
		require.NotEmpty(t, s.Error)
		require.Empty(t, s.Keys)
		bad[s.Subject] = s.SubjectBase64
	}
	require.Equal(t, base64.StdEncoding.EncodeToString([]byte("b\xffd")), bad["b\uFFFDd"])
	require.Contains(t, bad, "far")
	require.Empty(t, bad["far"])
	require.Equal(t, "good", fr.Top[2].Subject)

	out, err = e.cl2Run("-json", "-limit", "1/10s:1", "-count", "3", "-interval", "5ms", "watch", "api")
	require.NoError(t, err, "watch goes on past unreadable subjects")
	dec := json.NewDecoder(strings.NewReader(out))
	n := 0
	for dec.More() {
		var f cl2Frame
		require.NoError(t, dec.Decode(&f))
		require.Equal(t, 3, f.Subjects)
		n++
	}
	require.Equal(t, 3, n)
}

// TestReviewCL2ManyScanPages: a keyspace of many SCAN pages behind a slow
// proxy: each page and each State call within -timeout, the run as a
// whole longer than -timeout, finishes and lists correctly.
func TestReviewCL2ManyScanPages(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	srv.RequireReal(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	prefix := "cl2:"
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	lim, err := reserve.New(eng, "api", throttle.Every(10*time.Second, 1, 0))
	require.NoError(t, err)
	pipe := rdb.Pipeline()
	for i := 0; i < 12000; i++ { // tombstone-like keys matching the pattern, and others
		pipe.Set(ctx, fmt.Sprintf("%sapi:{t%d}:x:%d", prefix, i%50, i), "1", time.Minute)
		pipe.Set(ctx, fmt.Sprintf("other:%d", i), "1", time.Minute)
	}
	_, err = pipe.Exec(ctx)
	require.NoError(t, err)
	for i := 0; i < 20; i++ {
		r, err := lim.Reserve(ctx, fmt.Sprintf("s%02d", i))
		require.NoError(t, err)
		require.True(t, r.OK())
	}
	p := redistest.NewProxy(t, srv.Addr)
	p.SetLatency(40 * time.Millisecond) // ~80 ms per call
	start := time.Now()
	var out bytes.Buffer
	err = run(ctx, []string{"-redis", "redis://" + p.Addr(), "-prefix", prefix, "-timeout", "600ms", "-json", "-top", "0",
		"inspect", "api"}, &out)
	el := time.Since(start)
	t.Logf("24k keys, 80 ms round trips, -timeout 600ms: %v after %v", err, el)
	require.NoError(t, err)
	fr := cl2Decode(t, out.String())
	require.Equal(t, 20, fr.Subjects)
	require.Greater(t, el, 600*time.Millisecond, "the run outlasts one -timeout (many calls)")
}

// TestReviewCL2Cluster: on a 3-master Cluster (the viewer re-created over
// the Cluster client): figures against Limiter.State, a protocol-1 key,
// a corrupt subject listed apart, reset of both.
func TestReviewCL2Cluster(t *testing.T) {
	t.Parallel()
	c := redistest.StartCluster(t, 3)
	cc := c.Client(t)
	ctx := context.Background()
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(cc, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	first, minute := throttle.Every(10*time.Second, 1, 1), throttle.Every(time.Minute, 3, 1)
	lim, err := reserve.New(eng, "api", first, reserve.WithLimit(minute))
	require.NoError(t, err)
	subs := []string{"a", "b", "c", "d", "e", "f"}
	for i, s := range subs {
		for j := 0; j <= i%3; j++ {
			_, err := lim.Reserve(ctx, s)
			require.NoError(t, err)
		}
	}
	tm, err := cc.Time(ctx).Result()
	require.NoError(t, err)
	require.NoError(t, cc.Set(ctx, prefix+"api:{a}:1m0s", strconv.FormatInt(tm.UnixMicro()+50_000_000, 10), time.Minute).Err())
	require.NoError(t, cc.Set(ctx, prefix+"api:{zz}", "garbage", time.Minute).Err())

	runC := func(args ...string) (string, error) {
		var out bytes.Buffer
		err := run(ctx, append([]string{"-redis", "redis://" + c.Addrs[1], "-prefix", prefix}, args...), &out)
		return out.String(), err
	}
	out, err := runC("-json", "-top", "0", "-limit", "1/10s:1", "-limit", "3/1m:1", "inspect", "api")
	require.Error(t, err, "zz is corrupt")
	require.False(t, errors.Is(err, errUsage))
	fr := cl2Decode(t, out)
	require.Equal(t, 7, fr.Subjects)
	require.Equal(t, "zz", fr.Top[0].Subject)
	require.NotEmpty(t, fr.Top[0].Error)
	for _, s := range fr.Top[1:] {
		st, err := lim.State(ctx, s.Subject)
		require.NoError(t, err)
		require.Empty(t, s.Error)
		require.NotNil(t, s.Available)
		require.Equal(t, st.Available, *s.Available, s.Subject)
		if st.Wait > time.Second {
			require.Equal(t, st.NextFree.UnixMicro(), mustParseTime(t, s.NextFree).UnixMicro(), s.Subject)
		}
		if s.Subject == "a" {
			require.Len(t, s.Keys, 3)
			require.True(t, s.Keys[2].Protocol1)
		}
	}
	_, err = runC("reset", "api", "zz")
	require.NoError(t, err)
	_, err = runC("reset", "api", "a")
	require.NoError(t, err)
	for _, k := range []string{"api:{a}", "api:{a}:60000ms", "api:{a}:1m0s", "api:{zz}"} {
		n, err := cc.Exists(ctx, prefix+k).Result()
		require.NoError(t, err)
		require.Zero(t, n, k)
	}
	_, err = runC("inspect", "api")
	require.NoError(t, err)
}

// TestReviewCL2NextFreeDate: the date appears exactly when NEXT FREE is a
// day or more past the reading's Redis now, not for a slot less than a
// day away (whatever the calendar day).
func TestReviewCL2NextFreeDate(t *testing.T) {
	t.Parallel()
	e := rvNewEnv(t, "")
	lim := e.limiter(t, "api", throttle.Every(23*time.Hour, 1, 0))
	e.book(t, lim, "near", 1) // next free 23 h away
	lim2 := e.limiter(t, "api2", throttle.Every(25*time.Hour, 1, 0))
	e.book(t, lim2, "far", 1) // 25 h away
	text, err := e.cl2Run("-limit", "1/23h", "inspect", "api")
	require.NoError(t, err)
	st, err := lim.State(context.Background(), "near")
	require.NoError(t, err)
	require.Contains(t, text, st.NextFree.Format("15:04:05.000"))
	require.NotContains(t, text, st.NextFree.Format("2006-01-02 15:04"))
	text, err = e.cl2Run("-limit", "1/25h", "inspect", "api2")
	require.NoError(t, err)
	st, err = lim2.State(context.Background(), "far")
	require.NoError(t, err)
	require.Contains(t, text, st.NextFree.Format("2006-01-02 15:04:05.000"))
}

// JUDGEMENT (fixed): with -limit given, a live key of a period that is
// not among the limits (left by an earlier configuration, until it
// expires) made WAIT, NEXT FREE and AVAILABLE vanish for the subject,
// and its TAT counted in BACKLOG, although the limiter as configured
// neither reads it nor is held back by it (compare the protocol-1 fix:
// a key the library does not read counts in none of the figures). It is
// now listed apart, "not_read", in none of the figures.
func TestReviewCL2StaleLiveKeyHidesWait(t *testing.T) {
	t.Parallel()
	e := rvNewEnv(t, "")
	first, hour, minute := throttle.Every(10*time.Second, 1, 0), throttle.Every(time.Hour, 100, 0), throttle.Every(time.Minute, 1, 0)
	old := e.limiter(t, "api", first, minute)
	e.book(t, old, "s", 3) // minute key: 3 min ahead
	lim := e.limiter(t, "api", first, hour)
	e.book(t, lim, "s", 1)
	st, err := lim.State(context.Background(), "s")
	require.NoError(t, err)
	out, err := e.cl2Run("-json", "-limit", "1/10s:0", "-limit", "100/1h:0", "inspect", "api", "s")
	require.NoError(t, err)
	fr := cl2Decode(t, out)
	require.Len(t, fr.Top, 1)
	s := fr.Top[0]
	t.Logf("library: wait %v available %d backlog %v; CLI: %s", st.Wait, st.Available, st.Backlog, out)
	require.NotNil(t, s.Wait, "WAIT under the limits given")
	require.NotNil(t, s.Available)
	require.Equal(t, st.Available, *s.Available)
	require.InDelta(t, st.Backlog.Seconds(), s.Backlog, 1)
}

// TestReviewCL2Names: limiter names as reserve.New takes them.
func TestReviewCL2Names(t *testing.T) {
	t.Parallel()
	e := rvNewEnv(t, "")
	for _, n := range []string{"a*b", "a b", "-x", "ü", "[x]"} {
		lim := e.limiter(t, n, throttle.Every(10*time.Second, 1, 0))
		e.book(t, lim, "s", 1)
		out, err := e.cl2Run("-json", "inspect", "--", n)
		require.NoError(t, err, n)
		require.Equal(t, 1, cl2Decode(t, out).Subjects, n)
	}
	for _, n := range []string{"", "a:b", "a{", "}"} {
		_, err := e.cl2Run("inspect", n)
		require.ErrorIs(t, err, errUsage, "%q", n)
	}
}
