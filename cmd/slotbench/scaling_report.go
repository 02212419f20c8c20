package main

import (
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
)

// point returns the single-server point of strat at keys, procs and
// goroutines, and whether the run has it.
func (s *ScalingReport) point(strat string, keys, procs, g int) (ScalePoint, bool) {
	for _, p := range s.Points {
		if p.Strategy == strat && p.Keys == keys && p.Procs == procs && p.Goroutines == g {
			return p, true
		}
	}
	return ScalePoint{}, false
}

// roundSpread returns the lowest and highest over the rounds of a's
// granted/s over b's in the same round, and false if the points share no
// round with a rate for b.
func roundSpread(a, b ScalePoint) (lo, hi float64, ok bool) {
	for i := range min(len(a.RoundPerSec), len(b.RoundPerSec)) {
		if a.RoundPerSec[i] <= 0 || b.RoundPerSec[i] <= 0 { // a round that did not run
			continue
		}
		r := a.RoundPerSec[i] / b.RoundPerSec[i]
		if !ok {
			lo, hi, ok = r, r, true
		}
		lo, hi = min(lo, r), max(hi, r)
	}
	return lo, hi, ok
}

// ratioCell is a's granted/s over b's, followed by roundSpread's range
// when there is more than one round.
func ratioCell(a, b ScalePoint) string {
	if b.PerSec == 0 {
		return "–"
	}
	cell := fmt.Sprintf("%.2f", a.PerSec/b.PerSec)
	if lo, hi, ok := roundSpread(a, b); ok && min(len(a.RoundPerSec), len(b.RoundPerSec)) > 1 {
		cell += fmt.Sprintf(" (%.2f–%.2f)", lo, hi)
	}
	return cell
}

// manyKeys is the run's largest key count above 1 (10,000 by default).
func (s *ScalingReport) manyKeys() int {
	n := 0
	for _, p := range s.Points {
		if p.Keys > 1 {
			n = max(n, p.Keys)
		}
	}
	return n
}

// judgeScaling adds the targets of issue 16, each where the run has its
// points.
func (r *Report) judgeScaling() {
	s := r.Scaling
	if s == nil {
		return
	}
	add := func(name string, v float64, want string, met bool) {
		r.Targets = append(r.Targets, Target{Name: name, Value: v, Want: want, Met: met})
	}
	co, okC := s.point(stratCoalesced, 1, 1, 64)
	rr, okR := s.point(stratRedisRate, 1, 1, 64)
	if okC && okR && rr.PerSec > 0 && rr.CPUPerGranted > 0 {
		v := co.PerSec / rr.PerSec
		add("scaling, 1 key, 64 goroutines: coalesced granted/s / redis_rate's", v, ">= 5", v >= 5)
		add("scaling, 1 key, 64 goroutines: coalesced Redis calls per granted request", co.CallsPerGranted, "<= 0.05", co.CallsPerGranted <= 0.05)
		v = co.CPUPerGranted / rr.CPUPerGranted
		add("scaling, 1 key, 64 goroutines: coalesced server CPU per granted / redis_rate's", v, "<= 0.1", v <= 0.1)
	}
	if many := s.manyKeys(); many > 0 {
		worst, found := 0.0, false
		for _, p := range s.Points {
			if p.Keys != many || p.Strategy != stratCoalesced {
				continue
			}
			if q, ok := s.point(stratRedisRate, many, p.Procs, p.Goroutines); ok && q.PerSec > 0 {
				v := p.PerSec / q.PerSec
				if !found || v < worst {
					worst, found = v, true
				}
			}
		}
		if found {
			add(fmt.Sprintf("scaling, %d keys, lowest over goroutines and processes: coalesced granted/s / redis_rate's", many),
				worst, ">= 1", worst >= 1)
		}
	}
	var worstMem float64
	for _, m := range s.Memory {
		if !strings.HasPrefix(m.Name, "slotbook") {
			continue
		}
		for _, f := range s.Memory {
			if f.Keys == m.Keys && strings.HasPrefix(f.Name, "floor") && f.UsagePerKey > 0 {
				worstMem = max(worstMem, m.UsagePerKey/f.UsagePerKey)
			}
		}
	}
	if worstMem > 0 {
		add("memory per key at scale (highest over key counts) / integer-plus-expiry floor", worstMem, "<= 1.05", worstMem <= 1.05)
	}
	on, okOn := s.point(stratCoalesced, 1, 1, 4)
	off, okOff := s.point(stratUncoalesced, 1, 1, 4)
	if okOn && okOff && off.PerSec > 0 {
		v := on.PerSec / off.PerSec
		add("scaling, 1 key, 4 goroutines: coalesced granted/s / uncoalesced", v, ">= 1", v >= 1)
	}
}

// plural is "1 key", "10,000 keys".
func plural(n int, one string) string {
	s := strconv.Itoa(n)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	if n == 1 {
		return s + " " + one
	}
	return s + " " + one + "s"
}

func (s *ScalingReport) markdown(b *strings.Builder) {
	outDir := s.linkBase
	p := func(format string, a ...any) { fmt.Fprintf(b, format, a...) }
	p("\n## Scaling\n\n")
	limit := ""
	if s.Limit != "" {
		limit = " (" + s.Limit + ")"
	}
	p("Each point: %.1f s of requests under a limit never reached%s, in %d rounds in which the four strategies take turns (in a different order each round), ", s.Seconds, limit, s.Rounds)
	p("on a redis-server started afresh for each number of keys, processes and goroutines, ")
	p("from the given goroutines in all processes together (each process re-executes slotbench and runs its share); every goroutine takes the next key in turn. ")
	p("A request is granted when it is let through at once, as redis_rate's Allow grants it: a reservation whose slot was now when Redis booked it, a pool job booked so. ")
	p("One that is not (a reservation booked for a later slot, a pool job that waited for one, a request redis_rate refused) is not counted as granted, in granted/s or in any figure per granted request, but apart, and means the point reached the limit. ")
	p("Server CPU is the used_cpu_sys + used_cpu_user delta of the server(s) over the point, per granted request; command µs is the time INFO commandstats gives the scripts the clients sent (EVALSHA and EVAL, each with the commands it runs, which commandstats also lists on their own lines and which are not added again), per granted request: the server's time in commands, no I/O (timed by the clock, so on a busy machine it can exceed the CPU). ")
	p("Client CPU is the client processes' own user + system time (getrusage) over their rounds, per granted request: with one process it includes slotbench's idle goroutines. ")
	p("Latency is from the call to the answer (for the pool, from Submit to the job's start). The clients and the server share this machine's cores, so a client that spends less CPU leaves more to the server. ")
	p("In the side-by-side table, the range after a ratio of granted/s is its lowest and highest over the rounds (every round runs each strategy once, one after another, so each round is a paired comparison): where the range spans 1, the point does not tell the two strategies apart on this machine.\n\n")
	s.limitReached(b)
	for _, f := range s.Plots {
		rel, err := filepath.Rel(outDir, f)
		if err != nil {
			rel = f
		}
		p("![%s](%s)\n", strings.TrimSuffix(filepath.Base(f), ".png"), filepath.ToSlash(rel))
	}
	if len(s.Plots) > 0 {
		p("\n")
	}
	p("### Side by side with redis_rate (same keys, processes and goroutines)\n\n")
	p("| keys | procs | goroutines | coalesced / redis_rate granted/s | uncoalesced / redis_rate | pool / redis_rate | coalesced calls/granted | coalesced / redis_rate server CPU per granted | coalesced / redis_rate client CPU per granted |\n")
	p("|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, q := range s.Points {
		if q.Strategy != stratRedisRate || q.PerSec == 0 {
			continue
		}
		co, _ := s.point(stratCoalesced, q.Keys, q.Procs, q.Goroutines)
		un, _ := s.point(stratUncoalesced, q.Keys, q.Procs, q.Goroutines)
		po, _ := s.point(stratPool, q.Keys, q.Procs, q.Goroutines)
		cpu, client := 0.0, 0.0
		if q.CPUPerGranted > 0 {
			cpu = co.CPUPerGranted / q.CPUPerGranted
		}
		if q.ClientCPUPerGranted > 0 {
			client = co.ClientCPUPerGranted / q.ClientCPUPerGranted
		}
		p("| %d | %d | %d | %s | %s | %.2f | %.3f | %.2f | %.2f |\n", q.Keys, q.Procs, q.Goroutines,
			ratioCell(co, q), ratioCell(un, q), po.PerSec/q.PerSec, co.CallsPerGranted, cpu, client)
	}
	p("\n### Every point\n\n")
	p("| keys | procs | goroutines | strategy | granted/s | calls/granted | server CPU µs/granted | command µs/granted | client CPU µs/granted | p50 | p99 | errors |\n")
	p("|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, q := range s.Points {
		p("| %d | %d | %d | %s | %.0f | %.3f | %.2f | %.2f | %.2f | %s | %s | %s |\n", q.Keys, q.Procs, q.Goroutines, q.Strategy,
			q.PerSec, q.CallsPerGranted, q.CPUPerGranted, q.CmdPerGranted, q.ClientCPUPerGranted, us(q.P50), us(q.P99), errCell(q))
	}
	if len(s.Cluster) > 0 {
		p("\n### Redis Cluster, 3 masters\n\n")
		p("The same points from one process on a 3-master cluster (emptied before each point), beside the single server's. ")
		p("Per node: the keys whose state it holds (by the cluster's slot map), granted requests on those keys, and its server CPU per such request. ")
		p("All three masters share this machine's 2 cores with the client, so a cluster cannot be faster here: the point is that per-node cost stays flat and keys spread evenly.\n\n")
		p("| keys | goroutines | strategy | granted/s | calls/granted | server CPU µs/granted, all nodes | single server's | per node: keys / granted / CPU µs per granted | errors |\n")
		p("|---:|---:|---|---:|---:|---:|---:|---|---:|\n")
		for _, q := range s.Cluster {
			single := "–"
			if sp, ok := s.point(q.Strategy, q.Keys, 1, q.Goroutines); ok {
				single = fmt.Sprintf("%.2f", sp.CPUPerGranted)
			}
			var nodes []string
			for _, n := range q.Nodes {
				nodes = append(nodes, fmt.Sprintf("%d / %d / %.2f", n.Keys, n.Granted, n.CPUPerGranted))
			}
			p("| %d | %d | %s | %.0f | %.3f | %.2f | %s | %s | %s |\n", q.Keys, q.Goroutines, q.Strategy, q.PerSec,
				q.CallsPerGranted, q.CPUPerGranted, single, strings.Join(nodes, "; "), errCell(q))
		}
	}
	if len(s.Memory) > 0 {
		p("\n### Memory per key at scale\n\n")
		p("Each strategy filled to its limit (%d per minute) on a fresh redis-server; MEMORY USAGE is the exact cost of a key; the INFO delta, client connections left out as in the memory section above, adds the server's dictionaries and allocator slack.\n\n", perMinute)
		p("| keys | strategy | bytes/key (MEMORY USAGE) | / floor | bytes/key (INFO used_memory delta) |\n|---:|---|---:|---:|---:|\n")
		for _, m := range s.Memory {
			floor := 0.0
			for _, f := range s.Memory {
				if f.Keys == m.Keys && strings.HasPrefix(f.Name, "floor") && f.UsagePerKey > 0 {
					floor = m.UsagePerKey / f.UsagePerKey
				}
			}
			p("| %d | %s | %.1f | %.3f | %.1f |\n", m.Keys, m.Name, m.UsagePerKey, floor, m.InfoPerKey)
		}
	}
}

// limitReached says, loudly, which points reached the limit the scaling
// runs assume is never reached, or that none did.
func (s *ScalingReport) limitReached(b *strings.Builder) {
	var rows []string
	points := 0
	for _, set := range []struct {
		where  string
		points []ScalePoint
	}{{"single server", s.Points}, {"cluster", s.Cluster}} {
		for _, q := range set.points {
			points++
			if q.NotAtOnce > 0 {
				rows = append(rows, fmt.Sprintf("| %s | %d | %d | %d | %s | %d | %d |\n", set.where, q.Keys, q.Procs, q.Goroutines, q.Strategy, q.Granted, q.NotAtOnce))
			}
		}
	}
	if len(rows) == 0 {
		fmt.Fprintf(b, "Every request of every point was let through at once: no point reached the limit.\n\n")
		return
	}
	fmt.Fprintf(b, "**The limit was reached: in %d of the %d points, requests were not let through at once.** ", len(rows), points)
	fmt.Fprintf(b, "Those points do not measure what the others do, the cost of a decision under a limit never reached: their reservations booked later slots (or their pool jobs waited for them) while redis_rate refused, and their granted/s and figures per granted request count only what was let through at once. Rerun with a higher limit (openLimit) before reading them.\n\n")
	fmt.Fprintf(b, "| where | keys | procs | goroutines | strategy | granted (at once) | not at once |\n|---|---:|---:|---:|---|---:|---:|\n")
	for _, r := range rows {
		b.WriteString(r)
	}
	b.WriteString("\n")
}

func errCell(q ScalePoint) string {
	if q.Errors == 0 {
		return "0"
	}
	return fmt.Sprintf("%d (%s)", q.Errors, strings.ReplaceAll(q.FirstError, "|", "/"))
}
