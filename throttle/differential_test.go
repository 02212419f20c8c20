package throttle_test

import (
	"context"
	"encoding/binary"
	"flag"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/model"
	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/throttle"
)

var (
	diffOps  = flag.Int("diff-ops", 20_000, "operations in TestDifferentialRandom")
	diffSeed = flag.Uint64("diff-seed", 0, "seed for TestDifferentialRandom (0: from the clock)")
)

// source yields choices: from a seeded generator, or from fuzz input.
type source interface{ Intn(n int) int }

type randSource struct{ r *rand.Rand }

func (s randSource) Intn(n int) int { return s.r.IntN(n) }

type byteSource struct {
	data []byte
	pos  int
}

func (s *byteSource) Intn(n int) int {
	if s.pos+2 > len(s.data) {
		return 0
	}
	v := int(binary.LittleEndian.Uint16(s.data[s.pos:]))
	s.pos += 2
	return v % n
}

func (s *byteSource) done() bool { return s.pos+2 > len(s.data) }

// differ runs operations against the engine on a real Redis and against
// the reference model, on the same explicit clock, and fails at the first
// difference in an answer or a stored value.
type differ struct {
	t      testing.TB
	e      *env
	m      *model.Model
	src    source
	limits []throttle.Limit // [0], [1] for single keys; [2], [3] layered
	now    int64
	offset int64 // the explicit clock's lead over the real one
	booked []booked
	ops    int
}

type booked struct {
	keys   []string
	limits []throttle.Limit
	eb     throttle.Booking
	mb     model.Booking
	at     int64
}

var periods = []time.Duration{time.Second, 250 * time.Millisecond, time.Minute, 3 * time.Second, 7 * time.Second}

func newDiffer(t testing.TB, e *env, src source) *differ {
	d := &differ{t: t, e: e, m: model.New(), src: src}
	for i := 0; i < 4; i++ {
		d.limits = append(d.limits, throttle.Every(periods[(src.Intn(len(periods))+i)%len(periods)], 1+src.Intn(30), src.Intn(6)))
	}
	// The layered pair needs distinct periods to mean something; any pair works for the arithmetic.
	d.now = time.Now().UnixMicro()
	return d
}

// tick advances the explicit clock by step, and keeps it near the real
// one. Under an explicit clock the scripts keep keys an hour past their
// TAT (clock.lua), so Redis's real-time expiry never drops a TAT this
// clock has not passed, however long the machine pauses between steps.
func (d *differ) tick(step int64) {
	d.offset += step
	d.now = max(d.now, time.Now().UnixMicro()+d.offset)
}

func (d *differ) ctx() context.Context { return testhook.WithNow(context.Background(), d.now) }

func mlimits(ls []throttle.Limit) []model.Limit {
	out := make([]model.Limit, len(ls))
	for i, l := range ls {
		out[i] = model.FromLimit(l)
	}
	return out
}

func (d *differ) request(limits []throttle.Limit) (throttle.Request, model.Request) {
	maxN := limits[0].Burst + 1
	for _, l := range limits {
		maxN = min(maxN, l.Burst+1)
	}
	n := 1 + d.src.Intn(maxN)
	switch d.src.Intn(4) {
	case 0:
		return throttle.Request{N: n, MaxWait: throttle.Forever}, model.Request{N: int64(n), MaxWait: throttle.MaxHorizon.Microseconds()}
	case 1:
		return throttle.Request{N: n, MaxWait: 0}, model.Request{N: int64(n)}
	default:
		w := int64(d.src.Intn(3_000_000))
		return throttle.Request{N: n, MaxWait: time.Duration(w) * time.Microsecond}, model.Request{N: int64(n), MaxWait: w}
	}
}

func (d *differ) step() {
	d.ops++
	single := []string{"k0", "k1"}
	layeredKeys, layeredLimits := []string{"{s}", "{s}:b"}, d.limits[2:4]
	ctx := context.Background()
	switch op := d.src.Intn(7); op {
	case 0, 1, 2: // Allow, Book, BookBatch on a single key
		i := d.src.Intn(2)
		keys, limits := single[i:i+1], d.limits[i:i+1]
		count := 1
		if op == 2 {
			count = 1 + d.src.Intn(5)
		}
		var ers []throttle.Request
		var mrs []model.Request
		for j := 0; j < count; j++ {
			er, mr := d.request(limits)
			if op == 0 {
				er.MaxWait, mr.MaxWait = 0, 0
			}
			ers, mrs = append(ers, er), append(mrs, mr)
		}
		d.compareBook(keys, limits, ers, mrs, op == 0)
	case 3: // layered
		count := 1 + d.src.Intn(3)
		var ers []throttle.Request
		var mrs []model.Request
		for j := 0; j < count; j++ {
			er, mr := d.request(layeredLimits)
			ers, mrs = append(ers, er), append(mrs, mr)
		}
		d.compareBook(layeredKeys, layeredLimits, ers, mrs, false)
	case 4: // refund an earlier booking
		if len(d.booked) == 0 {
			return
		}
		b := d.booked[d.src.Intn(len(d.booked))]
		got, err := d.e.eng.RefundAll(d.ctx(), b.keys, b.limits, b.eb)
		require.NoError(d.t, err)
		want := d.m.Refund(d.now, b.at, b.keys, b.mb)
		for i := range want {
			require.Equal(d.t, time.Duration(want[i])*time.Microsecond, got[i], "op %d: refund given to %s", d.ops, b.keys[i])
		}
		d.checkStored(b.keys)
	case 5: // shared back-off on a single key
		i := d.src.Intn(2)
		dur := int64(d.src.Intn(2_000_000))
		require.NoError(d.t, d.e.eng.Block(d.ctx(), single[i], d.limits[i], time.Duration(dur)*time.Microsecond))
		d.m.Block(d.now, single[i], model.FromLimit(d.limits[i]), dur)
		d.checkStored(single[i : i+1])
	case 6: // time passes
		d.tick(int64(d.src.Intn(600_000)))
	}
	_ = ctx
}

func (d *differ) compareBook(keys []string, limits []throttle.Limit, ers []throttle.Request, mrs []model.Request, allow bool) {
	want := d.m.Book(d.now, keys, mlimits(limits), mrs)
	if allow {
		r, err := d.e.eng.AllowAll(d.ctx(), keys, limits, ers[0].N)
		require.NoError(d.t, err)
		require.Equal(d.t, want[0].OK, r.Allowed, "op %d: allowed", d.ops)
		if !want[0].OK {
			require.Equal(d.t, time.Duration(want[0].Wait)*time.Microsecond, r.RetryAfter, "op %d: retry-after", d.ops)
		}
		d.checkStored(keys)
		return
	}
	got, err := d.e.eng.BookAll(d.ctx(), keys, limits, ers)
	require.NoError(d.t, err)
	for i := range want {
		require.Equal(d.t, want[i].OK, got[i].OK, "op %d request %d (%+v): booked", d.ops, i, ers[i])
		require.Equal(d.t, time.Duration(want[i].Wait)*time.Microsecond, got[i].Wait, "op %d request %d: wait", d.ops, i)
		if got[i].OK {
			d.booked = append(d.booked, booked{keys: keys, limits: limits, eb: got[i], mb: want[i], at: d.now})
			if len(d.booked) > 64 {
				d.booked = d.booked[1:]
			}
		}
	}
	d.checkStored(keys)
}

// checkStored compares Redis's stored TATs with the model's. A key Redis
// has expired (in real time) must have passed in the model too.
func (d *differ) checkStored(keys []string) {
	for _, k := range keys {
		want, ok := d.m.Get(k)
		got, err := d.e.rdb.Get(context.Background(), d.e.prefix+k).Int64()
		switch {
		case err == nil:
			require.True(d.t, ok, "op %d: Redis holds %s = %d, the model nothing", d.ops, k, got)
			require.Equal(d.t, want, got, "op %d: stored TAT of %s", d.ops, k)
		case err.Error() == "redis: nil":
			require.True(d.t, !ok || want <= d.now, "op %d: Redis lost %s, the model has %d (now %d)", d.ops, k, want, d.now)
		default:
			require.NoError(d.t, err)
		}
	}
}

// TestDifferentialRandom runs -diff-ops random operations (20,000 by
// default) against the scripts and the model.
func TestDifferentialRandom(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.srv.RequireReal(t)
	seed := *diffSeed
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	t.Logf("seed %d", seed)
	d := newDiffer(t, e, randSource{rand.New(rand.NewPCG(seed, seed>>1))})
	for d.ops < *diffOps {
		d.step()
	}
}

// FuzzEngine feeds arbitrary operation sequences to the scripts and the
// model. Its seed corpus (testdata/fuzz/FuzzEngine) runs with every go
// test; go test -fuzz FuzzEngine ./throttle explores further.
func FuzzEngine(f *testing.F) {
	f.Add([]byte("\x01\x00\x02\x00\x03\x00\x04\x00\x05\x00\x06\x00\x00\x00\x01\x00\x02\x00\x03\x00"))
	f.Add([]byte(fmt.Sprint("burst then refund: ", []int{1, 1, 1, 1, 4, 4, 6, 3, 3, 4})))
	e := newEnv(f)
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > 1024 {
			return
		}
		// Each input on fresh keys: a prefix of its own.
		e := e.fresh(t)
		src := &byteSource{data: data}
		d := newDiffer(t, e, src)
		for !src.done() {
			d.step()
		}
	})
}
