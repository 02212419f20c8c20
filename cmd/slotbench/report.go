package main

import (
	"fmt"
	"strings"
	"time"

	"github.com/slotbook/slotbook/internal/contention"
)

// Report is one slotbench run.
type Report struct {
	Date    string `json:"date"`
	Machine string `json:"machine"`
	Go      string `json:"go"`
	Redis   string `json:"redis_version"`
	Quick   bool   `json:"quick"`
	// Flags are the flags the run was given (a password in -redis's URL
	// redacted), in name order.
	Flags []string `json:"flags"`
	// FreshServers: each memory figure comes from a redis-server of its own.
	FreshServers bool                `json:"fresh_servers"`
	Memory       []MemoryRow         `json:"memory"`
	Latency      []LatencyRow        `json:"latency"`
	Contention   []contention.Result `json:"contention"`
	// ContentionSeconds is how long the contention clients start (retry)
	// or book (reserve, pool) requests: -contention.
	ContentionSeconds float64        `json:"contention_seconds"`
	Coalescing        CoalescingRow  `json:"coalescing"`
	Scaling           *ScalingReport `json:"scaling,omitempty"` // with -scaling
	Targets           []Target       `json:"targets"`
}

// Target is one goal, the measured ratio and whether it was met.
type Target struct {
	Name  string  `json:"name"`
	Value float64 `json:"value"`
	Want  string  `json:"want"`
	Met   bool    `json:"met"`
}

func (r *Report) memory(prefix string) MemoryRow {
	for _, m := range r.Memory {
		if strings.HasPrefix(m.Name, prefix) {
			return m
		}
	}
	return MemoryRow{}
}

func (r *Report) latency(prefix string) LatencyRow {
	for _, l := range r.Latency {
		if strings.HasPrefix(l.Name, prefix) {
			return l
		}
	}
	return LatencyRow{}
}

func (r *Report) mode(name string) contention.Result {
	for _, c := range r.Contention {
		if c.Mode == name {
			return c
		}
	}
	return contention.Result{}
}

// judge fills in the targets.
func (r *Report) judge() {
	add := func(name string, v float64, want string, met bool) {
		r.Targets = append(r.Targets, Target{Name: name, Value: v, Want: want, Met: met})
	}
	// Memory targets are judged on MEMORY USAGE, the exact cost of each
	// key; the INFO delta (client connections left out: measureMemory)
	// adds the server's dictionaries and allocator slack, which move by a
	// few bytes a key from run to run.
	sb, floor := r.memory("slotbook"), r.memory("floor")
	logm, rr := r.memory("sliding"), r.memory("go-redis")
	if floor.UsagePerKey > 0 && sb.UsagePerKey > 0 {
		v := sb.UsagePerKey / floor.UsagePerKey
		add("memory per key / integer-plus-expiry floor", v, "<= 1.05", v <= 1.05)
		v = logm.UsagePerKey / sb.UsagePerKey
		add("sliding log memory per key / slotbook's", v, ">= 20", v >= 20)
		v = sb.UsagePerKey / rr.UsagePerKey
		add("memory per key / redis_rate's", v, "< 1", v < 1)
	}
	// The per-call floor: what any Lua GCRA must do (TIME, GET, SET PX),
	// and the script the common guides write.
	res, rrl := r.latency("slotbook reserve"), r.latency("go-redis")
	ref, guide := r.latency("reference: a script doing only TIME"), r.latency("guide-style")
	if ref.UsecPerCall > 0 && ref.P50 > 0 {
		v := res.UsecPerCall / ref.UsecPerCall
		add("server CPU per reserve / TIME+GET+SET PX reference's", v, "<= 1.10", v <= 1.10)
		v = float64(res.P50) / float64(ref.P50)
		add("reserve p50 / TIME+GET+SET PX reference's p50", v, "<= 1.05", v <= 1.05)
	}
	if guide.UsecPerCall > 0 {
		v := res.UsecPerCall / guide.UsecPerCall
		add("server CPU per reserve / guide-style float script's", v, "<= 1", v <= 1)
	}
	if rrl.UsecPerCall > 0 {
		v := res.UsecPerCall / rrl.UsecPerCall
		add("server CPU per reserve / redis_rate Allow's", v, "<= 0.8", v <= 0.8)
	}
	if c := r.mode("reserve"); c.Through > 0 {
		add("contention: reservation calls per request", c.CallsPerRequest, "<= 1.00", c.CallsPerRequest <= 1.0)
	}
	if c := r.mode("pool"); c.Through > 0 {
		add("contention: pool calls per request", c.CallsPerRequest, "<= 0.10", c.CallsPerRequest <= 0.10)
	}
	if c := r.mode("retry"); c.Through > 0 {
		add("contention: retry-after-denial calls per request", c.CallsPerRequest, "about 18 (15 to 21)",
			c.CallsPerRequest >= 15 && c.CallsPerRequest <= 21)
	}
	if c := r.Coalescing; c.AlonePerSec > 0 {
		add("coalescing: reservations per second / uncoalesced, one call each (merging off)", c.Speedup, ">= 3", c.Speedup >= 3)
		add("coalescing: Redis calls per reservation", c.CallsPerReservation, "<= 0.3", c.CallsPerReservation <= 0.3)
	}
	r.judgeScaling()
}

func (r *Report) markdown() string {
	var b strings.Builder
	p := func(format string, a ...any) { fmt.Fprintf(&b, format, a...) }
	size := "full run"
	if r.Quick {
		size = "quick run"
	}
	p("# slotbook benchmarks\n\n")
	p("`%s` (%s), %s. Machine: %s; %s; Redis %s.\n", strings.Join(append([]string{"go run ./cmd/slotbench"}, r.Flags...), " "), size, r.Date, r.Machine, r.Go, r.Redis)
	p("Every figure comes from this one run, %s; compare the ratios, not the absolute times.\n\n", r.servers())

	p("## Targets\n\n| target | measured | want | |\n|---|---:|---|---|\n")
	for _, t := range r.Targets {
		mark := "met"
		if !t.Met {
			mark = "**missed**"
		}
		p("| %s | %.3f | %s | %s |\n", t.Name, t.Value, t.Want, mark)
	}

	p("\n## Memory per key\n\n%d keys, each allowed %d per minute and filled to the limit, all under the same key names", r.memKeys(), perMinute)
	if r.FreshServers {
		p(", each strategy on a fresh redis-server")
	} else {
		p(", all on the one Redis given (so each delta may include some of the server's own growth)")
	}
	p("%s\n\n", memoryNote)
	p("| strategy | bytes/key (INFO used_memory delta) | bytes/key (MEMORY USAGE) |\n|---|---:|---:|\n")
	for _, m := range r.Memory {
		p("| %s | %.1f | %.1f |\n", m.Name, m.InfoPerKey, m.UsagePerKey)
	}

	p("\n## Cost per check\n\nEach call timed after a PING timed in the same loop, the kinds of call interleaved in rounds of 100 calls (10 rounds at least); p50 and p99 by nearest rank (of n times, the ceil(n/2)-th and ceil(0.99n)-th smallest, as in the scaling tables); server µs per call from INFO commandstats: the median over the rounds of each round's µs of the scripts the calls sent, over its timed calls, so per timed call as p50 is (the lease row's call sends two scripts, Acquire's and Release's, and is charged both). ")
	p("The reference rows bound what a GCRA script can cost here: an empty script is what any EVALSHA costs, a script doing only TIME, GET and SET PX (no arithmetic) is what every GCRA in this table must do, and the same script taking slotbook's four arguments and answering as book1.lua does (the Redis time as TIME gave it) is what slotbook's wire protocol adds before any arithmetic")
	res, ref, proto := r.latency("slotbook reserve"), r.latency("reference: a script doing only TIME"), r.latency("reference: the same with slotbook's")
	share := func(of LatencyRow) {
		if ref.UsecPerCall > 0 && ref.UsecPerCall < of.UsecPerCall && of.UsecPerCall <= res.UsecPerCall {
			p(" (in this run %.2fx the three commands' cost, %.0f%% of the way from them to slotbook reserve's)",
				of.UsecPerCall/ref.UsecPerCall, 100*(of.UsecPerCall-ref.UsecPerCall)/(res.UsecPerCall-ref.UsecPerCall))
		}
	}
	share(proto)
	p("; working out, as well, the Redis time in microseconds as a number and storing it as one integer, as slotbook works out and stores a TAT, is the least a script storing a sum of microseconds does before any decision")
	integer := r.latency("reference: the same, storing")
	share(integer)
	if integer.UsecPerCall > 0 {
		p(", and slotbook reserve costs %.2fx that", res.UsecPerCall/integer.UsecPerCall)
	}
	p(".\n\n")
	p("| call | p50 | p99 | PING p50 | PING p99 | p50 / PING p50 | server µs per timed call |\n|---|---:|---:|---:|---:|---:|---:|\n")
	for _, l := range r.Latency {
		p("| %s | %s | %s | %s | %s | %.2f | %.2f |\n", l.Name, us(l.P50), us(l.P99), us(l.PingP50), us(l.PingP99),
			float64(l.P50)/float64(max(l.PingP50, 1)), l.UsecPerCall)
	}

	p("\n## Contention\n\n20 clients, %d/s burst %d, modes one after another. ", contentionLimit.Rate, contentionLimit.Burst)
	p("\"Through\" counts the requests that started, and the modes count them over different windows: retry starts a request only within the run's time, while reserve and pool book within it and start each request at its slot, up to the max wait (%g s) later", contentionMaxWait.Seconds())
	if d := r.ContentionSeconds; d > 0 {
		l := contentionLimit
		perSec := float64(l.Rate) / l.Period.Seconds()
		w := d + contentionMaxWait.Seconds()
		p(". With %g s to start or book in, at the limit's rate that is its burst plus %g a second of the window: %d + %g × %g = %.0f for retry, %d + %g × %g = %.0f for reserve and pool",
			d, perSec, l.Burst, perSec, d, float64(l.Burst)+perSec*d, l.Burst, perSec, w, float64(l.Burst)+perSec*w)
	}
	p(". A difference in through between retry and the others is the window, not throughput: compare calls per request and spacing.\n\n")
	p("| mode | through | Redis calls | denials | calls/request | mean spacing | min spacing |\n|---|---:|---:|---:|---:|---:|---:|\n")
	for _, c := range r.Contention {
		p("| %s | %d | %d | %d | %.2f | %s | %s |\n", c.Mode, c.Through, c.Calls, c.Denials, c.CallsPerRequest, ms(c.MeanSpacing), ms(c.MinSpacing))
	}

	c := r.Coalescing
	p("\n## Coalescing\n\n64 goroutines reserving %d slots on one key under a limit never reached.\n\n", c.Reservations)
	p("Uncoalesced callers run twice: as a default client runs them, where single bookings that find every connection busy, or four bookings in flight, are merged into shared calls (`throttle.WithMerging`, `throttle.WithMergeAt`), and with merging off, one call each; the target compares coalescing with the latter.\n\n")
	p("| | reservations/s | Redis calls/reservation | coalesced's reservations/s over this |\n|---|---:|---:|---:|\n")
	p("| coalesced | %.0f | %.3f | |\n", c.CoalescedPerSec, c.CallsPerReservation)
	p("| uncoalesced, merged | %.0f | %.3f | %.2f |\n", c.UncoalescedPerSec, c.UncoalescedCalls, c.CoalescedPerSec/c.UncoalescedPerSec)
	p("| uncoalesced, one call each (merging off) | %.0f | %.3f | %.2f |\n", c.AlonePerSec, c.AloneCalls, c.Speedup)
	if r.Scaling != nil {
		r.Scaling.markdown(&b)
	}
	return b.String()
}

// memoryNote says what the memory columns are.
const memoryNote = ". The targets are judged on MEMORY USAGE, the exact cost of each key. The INFO delta is used_memory after the fill less before, with every client connection's memory (CLIENT LIST's tot-mem) taken out of both readings and the fill made through connections of its own, closed before the second: beyond MEMORY USAGE it holds the server's dictionaries (a table being resized holds its old one too) and allocator slack, and moves by a few bytes a key from run to run."

// servers says which Redis servers the run's figures come from.
func (r *Report) servers() string {
	var s string
	if r.FreshServers {
		s = "memory per key with each strategy on a redis-server started for it, cost per check, contention and coalescing on one redis-server started for the run"
	} else {
		s = "memory per key, cost per check, contention and coalescing on the one Redis given (-redis)"
	}
	if r.Scaling != nil {
		s += ", the scaling points on a redis-server started afresh for each number of keys, processes and goroutines"
		if len(r.Scaling.Cluster) > 0 {
			s += " and on a 3-master Redis Cluster started for the run"
		}
		if len(r.Scaling.Memory) > 0 {
			s += ", memory at scale with each row on a redis-server started for it"
		}
	}
	return s
}

func (r *Report) memKeys() int {
	if len(r.Memory) == 0 {
		return 0
	}
	return r.Memory[0].Keys
}

func us(d time.Duration) string { return fmt.Sprintf("%.1fµs", float64(d)/float64(time.Microsecond)) }
func ms(d time.Duration) string { return fmt.Sprintf("%.1fms", float64(d)/float64(time.Millisecond)) }
