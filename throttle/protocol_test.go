package throttle

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/internal/testhook"
)

// The wire protocol's test vectors (docs/PROTOCOL.md): a file that clients
// in other languages check themselves against. Its expected values were
// worked out by hand from the definition of GCRA, not recorded from the
// scripts; this test holds the scripts, and the engine that calls them, to
// the file.

type vectorFile struct {
	Protocol int      `json:"protocol"`
	HoldMS   int64    `json:"explicit_now_hold_ms"`
	Horizon  int64    `json:"horizon_us"`
	Vectors  []vector `json:"vectors"`
}

type vector struct {
	Name   string               `json:"name"`
	Script string               `json:"script"`
	Now    int64                `json:"now"`
	Input  vectorInput          `json:"input"`
	Keys   []string             `json:"keys"`
	Argv   []string             `json:"argv"`
	Before map[string]*keyState `json:"before"`
	Reply  json.RawMessage      `json:"reply"`
	// Judged and Outcomes: for book, the TATs each request is judged
	// against and what it gets, worked out by hand (the reply carries only
	// the first request's TATs and how many of each run were booked).
	Judged   [][]int64 `json:"judged"`
	Outcomes []struct {
		Booked bool  `json:"booked"`
		WaitUS int64 `json:"wait_us"`
	} `json:"outcomes"`
	// Expect: for book1, whose reply is a string, what the engine makes
	// of it.
	Expect *struct {
		Booked bool  `json:"booked"`
		WaitUS int64 `json:"wait_us"`
		Tat    int64 `json:"tat"`
	} `json:"expect"`
	Error string               `json:"error"`
	After map[string]*keyState `json:"after"`
}

type keyState struct {
	Value *string          `json:"value"`
	Zset  map[string]int64 `json:"zset"`
	PX    *int64           `json:"px"`
}

type vectorInput struct {
	Prefix string `json:"prefix"`
	Keys   []string
	Limits []struct {
		Rate     int   `json:"rate"`
		PeriodMS int64 `json:"period_ms"`
		Burst    int   `json:"burst"`
	} `json:"limits"`
	Requests []struct {
		N         int   `json:"n"`
		MaxWaitUS int64 `json:"max_wait_us"`
	} `json:"requests"`
	Booking *struct {
		Now       int64   `json:"now"`
		N         int     `json:"n"`
		WaitUS    int64   `json:"wait_us"`
		TatBefore []int64 `json:"tat_before"`
		TatAfter  []int64 `json:"tat_after"`
		ID        string  `json:"id"`
		// Unused: given back as a booking no one acted on (RefundUnused).
		Unused bool `json:"unused"`
	} `json:"booking"`
	PauseUS int64 `json:"pause_us"`
	Window  *struct {
		Max    int   `json:"max"`
		SpanUS int64 `json:"span_us"`
	} `json:"window"`
	N int `json:"n"`
}

func (in vectorInput) limits() []Limit {
	var ls []Limit
	for _, l := range in.Limits {
		ls = append(ls, Every(time.Duration(l.PeriodMS)*time.Millisecond, l.Rate, l.Burst))
	}
	return ls
}

var vectorScripts = map[string]*script{
	"book1": book1Script, "book": bookScript, "refund": refundScript,
	"block": blockScript, "reset": resetScript, "window": windowScript,
}

func loadVectors(t *testing.T) vectorFile {
	t.Helper()
	data, err := os.ReadFile("testdata/protocol_vectors.json")
	require.NoError(t, err)
	var f vectorFile // "note" and "about" are for readers
	require.NoError(t, json.Unmarshal(data, &f))
	require.NotEmpty(t, f.Vectors)
	return f
}

func TestProtocolVectors(t *testing.T) {
	srv := redistest.Shared(t)
	srv.RequireReal(t) // the scripts' exact behaviour, on the server they run on
	f := loadVectors(t)
	require.Equal(t, ProtocolVersion, f.Protocol, "the vectors' protocol version")
	require.Equal(t, int64(MaxHorizon/time.Microsecond), f.Horizon, "the horizon")
	require.Equal(t, int64(3600000), f.HoldMS, "clock.lua's hold under an explicit now")
	scripts := map[string]bool{}
	for _, v := range f.Vectors {
		scripts[v.Script] = true
		t.Run(v.Name, func(t *testing.T) {
			require.Contains(t, vectorScripts, v.Script)
			for k := range v.Before {
				require.Contains(t, v.After, k, "every key of before is in after")
			}
			require.True(t, (v.Error == "") != (v.Reply == nil), "a reply or an error")
			t.Run("script", func(t *testing.T) { runScriptVector(t, srv, f.HoldMS, v) })
			t.Run("engine", func(t *testing.T) { runEngineVector(t, srv, v) })
		})
	}
	require.Len(t, scripts, len(vectorScripts), "a vector for every script")
}

// mapper puts a test's own prefix before the vector's key names, so that
// the vectors run beside other tests on one server.
type mapper string

func (p mapper) key(k string) string { return string(p) + k }

func (p mapper) keys(ks []string) []string {
	out := make([]string, len(ks))
	for i, k := range ks {
		out[i] = p.key(k)
	}
	return out
}

// text maps the key names a vector's expected error names.
func (p mapper) text(v vector, s string) string {
	for k := range v.After {
		s = strings.ReplaceAll(s, "key "+k+" ", "key "+p.key(k)+" ")
	}
	return s
}

// setBefore writes the vector's starting state.
func setBefore(t *testing.T, rdb *redis.Client, p mapper, v vector) {
	t.Helper()
	ctx := context.Background()
	for k, st := range v.Before {
		k = p.key(k)
		require.NoError(t, rdb.Del(ctx, k).Err())
		px := time.Duration(0)
		if st.PX != nil {
			px = time.Duration(*st.PX) * time.Millisecond
		}
		if st.Value != nil {
			require.NoError(t, rdb.Set(ctx, k, *st.Value, px).Err())
			continue
		}
		for m, score := range st.Zset {
			require.NoError(t, rdb.ZAdd(ctx, k, redis.Z{Member: m, Score: float64(score)}).Err())
		}
		if px > 0 {
			require.NoError(t, rdb.PExpire(ctx, k, px).Err())
		}
	}
}

// checkAfter compares the stored keys with the vector's end state.
func checkAfter(t *testing.T, rdb *redis.Client, p mapper, v vector) {
	t.Helper()
	ctx := context.Background()
	for k, want := range v.After {
		full := p.key(k)
		n, err := rdb.Exists(ctx, full).Result()
		require.NoError(t, err)
		if want == nil {
			require.Zero(t, n, "%s should not exist", k)
			continue
		}
		require.Equal(t, int64(1), n, "%s should exist", k)
		if want.Value != nil {
			got, err := rdb.Get(ctx, full).Result()
			require.NoError(t, err)
			require.Equal(t, *want.Value, got, "value of %s", k)
			continue
		}
		zs, err := rdb.ZRangeWithScores(ctx, full, 0, -1).Result()
		require.NoError(t, err)
		got := map[string]int64{}
		for _, z := range zs {
			got[fmt.Sprint(z.Member)] = int64(z.Score)
		}
		require.Equal(t, want.Zset, got, "members of %s", k)
	}
}

// replyInts reads a reply, an array of integers or one integer, as a list.
func replyInts(t *testing.T, reply any) []int64 {
	t.Helper()
	if n, ok := reply.(int64); ok {
		return []int64{n}
	}
	vals, err := int64s(reply, len(reply.([]any)))
	require.NoError(t, err)
	return vals
}

func wantInts(t *testing.T, raw json.RawMessage) []int64 {
	t.Helper()
	var one int64
	if json.Unmarshal(raw, &one) == nil {
		return []int64{one}
	}
	var many []int64
	require.NoError(t, json.Unmarshal(raw, &many))
	return many
}

// logShim is put before a script in runScriptVector: a local redis that
// records every command that sets a value or a time to live, with its
// arguments, in a list, so that the test sees each PX exactly (a TTL read
// afterwards has lost an unknown number of milliseconds). The script's
// logic is untouched: its own text follows, calling redis.call as ever.
const logShim = `local slotbook_log = ARGV_LOG_KEY
local slotbook_redis = redis
local redis = setmetatable({call = function(cmd, ...)
  local c = string.upper(cmd)
  if c == 'SET' or c == 'DEL' or c == 'PEXPIRE' or c == 'ZADD' then
    slotbook_redis.call('RPUSH', slotbook_log, cjson.encode({c, ...}))
  end
  return slotbook_redis.call(cmd, ...)
end}, {__index = slotbook_redis})
`

// runScriptVector runs the script's own text (with logShim before it) on
// the vector's keys and arguments, and checks the reply, the end state
// and every write.
func runScriptVector(t *testing.T, srv *redistest.Server, hold int64, v vector) {
	rdb := srv.Client(t)
	ctx := context.Background()
	p := mapper(redistest.Prefix(t))
	setBefore(t, rdb, p, v)
	logKey := p.key("log")
	src := strings.Replace(logShim, "ARGV_LOG_KEY", strconv.Quote(logKey), 1) + vectorScripts[v.Script].src
	args := make([]any, len(v.Argv))
	for i, a := range v.Argv {
		args[i] = a
	}
	reply, err := rdb.Eval(ctx, src, p.keys(v.Keys), args...).Result()
	if v.Error != "" {
		require.Error(t, err)
		require.True(t, strings.HasPrefix(err.Error(), p.text(v, v.Error)), "error %q, want it to start with %q", err, p.text(v, v.Error))
	} else {
		require.NoError(t, err)
		var str string
		if json.Unmarshal(v.Reply, &str) == nil {
			require.Equal(t, str, reply, "reply")
		} else {
			require.Equal(t, wantInts(t, v.Reply), replyInts(t, reply), "reply")
		}
	}
	checkAfter(t, rdb, p, v)

	// Every write, with its time to live.
	entries, err := rdb.LRange(ctx, logKey, 0, -1).Result()
	require.NoError(t, err)
	written := map[string][]string{} // key -> the writes to it
	for _, e := range entries {
		var w []string
		require.NoError(t, json.Unmarshal([]byte(e), &w))
		switch w[0] {
		case "DEL":
			for _, k := range w[1:] {
				written[k] = append(written[k], "DEL")
			}
		case "SET":
			require.Len(t, w, 5, "SET key value PX ms: %v", w)
			require.Equal(t, "PX", w[3])
			written[w[1]] = append(written[w[1]], "PX "+w[4])
		case "PEXPIRE":
			written[w[1]] = append(written[w[1]], "PX "+w[2])
		default:
			written[w[1]] = append(written[w[1]], w[0])
		}
	}
	for k, want := range v.After {
		got := written[p.key(k)]
		delete(written, p.key(k))
		switch {
		case want == nil:
			if v.Before[k] != nil {
				require.Contains(t, got, "DEL", "%s deleted", k)
			}
		case want.PX != nil:
			require.Contains(t, got, "PX "+strconv.FormatInt(*want.PX+hold, 10),
				"%s written with PX %d (+%d under an explicit now); writes: %v", k, *want.PX, hold, got)
		default:
			require.Empty(t, got, "%s must not be written", k)
		}
	}
	require.Empty(t, written, "writes to keys the vector does not name")
}

// argsHook records the keys and arguments of the last script call.
type argsHook struct {
	mu   sync.Mutex // guards last
	last []any
}

func (h *argsHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *argsHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if name := cmd.Name(); name == "evalsha" || name == "eval" {
			h.mu.Lock()
			h.last = cmd.Args()
			h.mu.Unlock()
		}
		return next(ctx, cmd)
	}
}

func (h *argsHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// sent returns the last script call's keys and arguments, as strings.
func (h *argsHook) sent(t *testing.T) (keys, args []string) {
	t.Helper()
	h.mu.Lock()
	defer h.mu.Unlock()
	require.GreaterOrEqual(t, len(h.last), 3, "a script call was made")
	n, err := strconv.Atoi(fmt.Sprint(h.last[2]))
	require.NoError(t, err)
	for i, a := range h.last[3:] {
		if i < n {
			keys = append(keys, fmt.Sprint(a))
		} else {
			args = append(args, fmt.Sprint(a))
		}
	}
	return keys, args
}

// runEngineVector makes the vector's call through the engine, from its
// inputs in the library's terms, at the vector's now (testhook), and
// checks that the engine sends the vector's keys and arguments and reads
// the reply as the vector says.
func runEngineVector(t *testing.T, srv *redistest.Server, v vector) {
	rdb := srv.Client(t)
	hook := &argsHook{}
	rdb.AddHook(hook)
	p := mapper(redistest.Prefix(t))
	eng, err := New(rdb, WithPrefix(p.key(v.Input.Prefix)), WithTimeout(5*time.Second))
	require.NoError(t, err)
	setBefore(t, rdb, p, v)
	ctx := testhook.WithNow(context.Background(), v.Now)
	in := v.Input
	var want []int64
	if v.Error == "" && v.Script != "book1" {
		want = wantInts(t, v.Reply)
	}

	switch v.Script {
	case "book1", "book":
		var reqs []Request
		for _, r := range in.Requests {
			reqs = append(reqs, Request{N: r.N, MaxWait: time.Duration(r.MaxWaitUS) * time.Microsecond})
		}
		bs, err := eng.BookAll(ctx, in.Keys, in.limits(), reqs)
		if v.Error != "" {
			require.ErrorIs(t, err, ErrCorruptState)
			require.Contains(t, err.Error(), p.key(v.Keys[0]), "the error names the key")
			break
		}
		require.NoError(t, err)
		if v.Script == "book1" {
			x := v.Expect
			require.NotNil(t, x, "book1's vectors say what the engine makes of the reply")
			require.Len(t, bs, 1)
			b := bs[0]
			require.Equal(t, x.Booked, b.OK, "booked")
			require.Equal(t, time.Duration(x.WaitUS)*time.Microsecond, b.Wait, "wait")
			require.Equal(t, time.UnixMicro(v.Now+x.WaitUS), b.At, "slot")
			require.Equal(t, []int64{x.Tat}, b.starts, "judged against")
			break
		}
		// {now, tat_1 .. tat_m, then per run: how many were booked}
		m := len(in.Keys)
		judged := v.Judged
		require.Len(t, judged, len(bs), "the TATs each request is judged against")
		require.Len(t, v.Outcomes, len(bs), "what each request gets")
		require.Equal(t, want[1:1+m], judged[0], "the reply's TATs are the first request's")
		for i, b := range bs {
			x := v.Outcomes[i]
			require.Equal(t, x.Booked, b.OK, "request %d booked", i)
			require.Equal(t, time.Duration(x.WaitUS)*time.Microsecond, b.Wait, "request %d wait", i)
			require.Equal(t, time.UnixMicro(v.Now+x.WaitUS), b.At, "request %d slot", i)
			require.Equal(t, judged[i], b.starts, "request %d judged against", i)
		}
	case "refund":
		bk := in.Booking
		id, err := strconv.ParseUint(bk.ID, 36, 64)
		require.NoError(t, err)
		b := Booking{OK: true, N: bk.N, Wait: time.Duration(bk.WaitUS) * time.Microsecond,
			now: bk.Now, starts: bk.TatBefore, ends: bk.TatAfter, id: id}
		refund := eng.RefundAll
		if bk.Unused {
			refund = eng.RefundUnused
		}
		given, err := refund(ctx, in.Keys, in.limits(), b)
		require.NoError(t, err)
		for i, g := range given {
			require.Equal(t, time.Duration(want[1+i])*time.Microsecond, g, "given back to key %d", i)
		}
	case "block":
		err := eng.BlockAll(ctx, in.Keys, in.limits(), time.Duration(in.PauseUS)*time.Microsecond)
		if v.Error != "" {
			require.ErrorIs(t, err, ErrCorruptState)
			break
		}
		require.NoError(t, err)
	case "reset":
		require.NoError(t, eng.Reset(ctx, in.Keys...))
	case "window":
		res, err := eng.AllowWindow(ctx, in.Keys[0], Window{Max: in.Window.Max, Span: time.Duration(in.Window.SpanUS) * time.Microsecond}, in.N)
		require.NoError(t, err)
		require.Equal(t, Result{Allowed: want[0] == 1, RetryAfter: time.Duration(want[1]) * time.Microsecond,
			Remaining: int(want[2]), ResetAfter: time.Duration(want[3]) * time.Microsecond}, res)
	default:
		t.Fatalf("no engine call for script %q", v.Script)
	}

	keys, args := hook.sent(t)
	require.Equal(t, p.keys(v.Keys), keys, "KEYS the engine sends")
	wantArgs := slices.Clone(v.Argv)
	if len(wantArgs) == 0 {
		wantArgs = nil
	}
	require.Equal(t, wantArgs, args, "ARGV the engine sends")
	checkAfter(t, rdb, p, v)
}

// TestProtocolV1Copy runs the script docs/PROTOCOL.md gives for carrying
// a version 1 key's TAT over to its version 2 name.
func TestProtocolV1Copy(t *testing.T) {
	srv := redistest.Shared(t)
	srv.RequireReal(t)
	doc, err := os.ReadFile("../docs/PROTOCOL.md")
	require.NoError(t, err)
	_, after, ok := strings.Cut(string(doc), "<!-- protocol-v1-copy -->\n```lua\n")
	require.True(t, ok, "docs/PROTOCOL.md lost its copy script marker")
	src, _, ok := strings.Cut(after, "```")
	require.True(t, ok)

	rdb := srv.Client(t)
	ctx := context.Background()
	p := mapper(redistest.Prefix(t))
	oldKey, newKey := p.key("slotbook:api:{s}:24h0m0s"), p.key("slotbook:api:{s}:86400000ms")
	run := func() int64 {
		t.Helper()
		n, err := rdb.Eval(ctx, src, []string{oldKey, newKey}).Int64()
		require.NoError(t, err)
		return n
	}
	require.Zero(t, run(), "no old key: nothing to copy")
	require.NoError(t, rdb.Set(ctx, oldKey, "1767225600100000", time.Hour).Err())
	require.Equal(t, int64(1), run())
	v, err := rdb.Get(ctx, newKey).Result()
	require.NoError(t, err)
	require.Equal(t, "1767225600100000", v)
	ttl, err := rdb.PTTL(ctx, newKey).Result()
	require.NoError(t, err)
	require.Greater(t, ttl, 50*time.Minute, "the old key's time to live")
	require.LessOrEqual(t, ttl, time.Hour)

	// A later TAT already under the new name is kept; an earlier one is
	// replaced.
	require.NoError(t, rdb.Set(ctx, newKey, "1767225600200000", time.Hour).Err())
	require.Zero(t, run())
	v, err = rdb.Get(ctx, newKey).Result()
	require.NoError(t, err)
	require.Equal(t, "1767225600200000", v)
	require.NoError(t, rdb.Set(ctx, newKey, "1767225600000001", time.Hour).Err())
	require.Equal(t, int64(1), run())
	v, err = rdb.Get(ctx, newKey).Result()
	require.NoError(t, err)
	require.Equal(t, "1767225600100000", v)
}
