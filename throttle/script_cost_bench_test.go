package throttle

import (
	"context"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/internal/refscripts"
)

// BenchmarkBook1ServerCost measures what book1.lua costs the server per
// call, beside the references slotbench's cost table judges it against,
// on one server, in interleaved rounds of 100 calls each (so that the
// machine's drift touches each alike), on one key under a limit never
// reached, as slotbench's reserve row books:
//
//   - floor: a script doing only TIME, GET and SET PX (slotbench's
//     "TIME+GET+SET PX reference");
//   - protocol: the same taking book1.lua's four arguments and answering
//     with TIME's two words (slotbench's protocol reference);
//   - wide: the protocol script storing a fixed 16-digit integer: what
//     storing a TAT's width costs over the floor's 10 digits (nothing
//     measurable here);
//   - integer: the protocol script working out the Redis time in
//     microseconds as a number and storing it as one integer
//     (string.format), as book1.lua works out and stores a TAT
//     (slotbench's integer reference): the arithmetic on TIME's words and
//     the formatting, which a script storing a sum (tat + step) as one
//     integer cannot skip (joining TIME's words, zero-padded, stores the
//     time cheaper, but cannot add);
//   - minimal: book1.lua's decision and replies without its checks of
//     the stored value and without its test clock: about the least a
//     GCRA keeping TAT as one integer, with book1.lua's protocol, does;
//   - unchecked: book1.lua without its two checks of the stored value
//     (an integer of at most 16 digits; not further ahead than any booking
//     reaches), which turn a foreign or corrupt value into an error
//     rather than a decision: the decision and its formatting alone;
//   - book1: book1.lua as the engine sends it.
//
// Each is reported as the median over the rounds of its server µs per
// call (INFO commandstats, EVALSHA's usec over its calls), and each
// ratio as the median over the rounds of that round's ratio, so that a
// round in which the machine was busy counts once. An op is one call (of
// any of the seven), its INFO readings included.
// unchecked/floor is what no script making book1.lua's decision, with
// book1.lua's reply, can go below without the checks; integer/floor and
// minimal/floor what a script storing a sum of microseconds as one
// integer (the memory floor) pays before and with a decision, and
// book1/integer what book1.lua adds to the former.
func BenchmarkBook1ServerCost(b *testing.B) {
	srv := redistest.Start(b)
	ctx := context.Background()
	rdb := redis.NewClient(srv.Options())
	b.Cleanup(func() { _ = rdb.Close() })
	unchecked := book1Script.src
	for _, check := range []struct{ from, to string }{
		{"if #v <= 16 and string.find(v, '^%d+$') then x = v + 0 end", "x = v + 0"},
		{"if x == nil or x > 9007199254740992 then", "if false then"},
		{"if x - now > 31622400000000 + 2 * reach then", "if false then"},
	} {
		if !strings.Contains(unchecked, check.from) {
			b.Fatalf("book1.lua no longer has %q: bring the unchecked variant in line", check.from)
		}
		unchecked = strings.Replace(unchecked, check.from, check.to, 1)
	}
	type probe struct {
		name string
		sc   *script
		args []any
		key  string
		per  []float64 // µs per call, one per round
	}
	// refscripts.Protocol storing a fixed 16-digit integer, not TIME's seconds.
	wide := strings.Replace(refscripts.Protocol, "KEYS[1], t[1], 'PX'", "KEYS[1], '1700000000123456', 'PX'", 1)
	if wide == refscripts.Protocol {
		b.Fatal("refscripts.Protocol no longer stores t[1]: bring the wide variant in line")
	}
	// book1.lua's arguments: the clock, n*I, tau+I, the max wait (µs).
	book1Args := []any{"", 1, 1_000_001, 1_000_000}
	probes := []*probe{
		{name: "floor", sc: newScript(refscripts.Floor)},
		{name: "protocol", sc: newScript(refscripts.Protocol), args: book1Args},
		{name: "wide", sc: newScript(wide), args: book1Args},
		{name: "integer", sc: newScript(refscripts.Integer), args: book1Args},
		{name: "minimal", sc: newScript(minimalGCRA), args: book1Args},
		{name: "unchecked", sc: newScript(unchecked), args: book1Args},
		{name: "book1", sc: book1Script, args: book1Args},
	}
	for i, p := range probes {
		p.key = "cost:{" + strconv.Itoa(i) + "}"
		if err := rdb.ScriptLoad(ctx, p.sc.src).Err(); err != nil {
			b.Fatal(err)
		}
	}
	usec := func() (calls, us float64) {
		info, err := rdb.Info(ctx, "commandstats").Result()
		if err != nil {
			b.Fatal(err)
		}
		for _, line := range strings.Split(info, "\r\n") {
			stats, ok := strings.CutPrefix(line, "cmdstat_evalsha:")
			if !ok {
				continue
			}
			for _, f := range strings.Split(stats, ",") {
				name, v, _ := strings.Cut(f, "=")
				x, _ := strconv.ParseFloat(v, 64)
				switch name {
				case "calls":
					calls = x
				case "usec":
					us = x
				}
			}
		}
		return calls, us
	}
	const perRound = 100
	b.ResetTimer()
	for r := 0; r*perRound*len(probes) < b.N; r++ {
		for k := range probes {
			p := probes[(k+r)%len(probes)]
			calls0, us0 := usec()
			for range perRound {
				cmd := redis.NewCmd(ctx, append([]any{"evalsha", p.sc.hash, 1, p.key}, p.args...)...)
				if err := rdb.Process(ctx, cmd); err != nil {
					b.Fatalf("%s: %v", p.name, err)
				}
			}
			calls1, us1 := usec()
			if calls1-calls0 != perRound {
				b.Fatalf("%s: the server counted %v calls of %d", p.name, calls1-calls0, perRound)
			}
			p.per = append(p.per, (us1-us0)/perRound)
		}
	}
	b.StopTimer()
	median := func(xs []float64) float64 {
		xs = slices.Clone(xs)
		slices.Sort(xs)
		return xs[len(xs)/2]
	}
	ratio := func(p, q *probe) float64 {
		rs := make([]float64, len(p.per))
		for i := range rs {
			rs[i] = p.per[i] / q.per[i]
		}
		return median(rs)
	}
	floor := probes[0]
	for _, p := range probes {
		b.ReportMetric(median(p.per), p.name+"-µs/call")
	}
	for _, p := range probes[1:] {
		b.ReportMetric(ratio(p, floor), p.name+"/floor")
	}
	named := func(name string) *probe {
		i := slices.IndexFunc(probes, func(p *probe) bool { return p.name == name })
		return probes[i]
	}
	b.ReportMetric(ratio(named("book1"), named("integer")), "book1/integer")
}

// minimalGCRA is book1.lua's decision and replies (a refusal writes
// nothing; the PX as book1.lua works it out) without its checks of the
// stored value and without its test clock: BenchmarkBook1ServerCost's
// "minimal" probe (helper-153's estimate of the least a GCRA keeping TAT
// as one integer does).
const minimalGCRA = `local t = redis.call('TIME')
local s, u = t[1], t[2]
local now = s * 1000000 + u
local v = redis.call('GET', KEYS[1])
local tat = now
if v then
  local x = v + 0
  if x > now then tat = x else v = nil end
end
local step = ARGV[2] + 0
local wait = tat + step - ARGV[3] - now
if wait > 0 and wait > ARGV[4] + 0 then
  if v then return s .. ' ' .. u .. ' -' .. v end
  return s .. ' ' .. u .. ' -'
end
local new = tat + step
local d = (now - new) / 1000
redis.call('SET', KEYS[1], string.format('%d', new), 'PX', string.format('%d', d % 1 - d + 1))
if v then return s .. ' ' .. u .. ' ' .. v end
return s .. ' ' .. u
`
