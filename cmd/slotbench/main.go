// Command slotbench measures slotbook against the alternatives, side by
// side in one run, on real redis-servers it starts (each strategy's memory
// on a server of its own, the rest on one) or on one Redis given with
// -redis: memory per key, cost per check
// (next to PING and to the floor any Lua GCRA pays), behaviour under
// contention, and coalescing throughput. With -scaling it also measures
// how cost grows with keys, clients and processes (fresh redis-servers, a
// 3-master Redis Cluster, memory at up to a million keys; -plots writes the
// curves as PNG files).
// Absolute times on a shared machine mean little; the ratios, measured in
// the same run against the same Redis, are the point. Each target is
// printed with its ratio, and a missed target says so.
//
//	go run ./cmd/slotbench -quick                      # CI-sized, on a redis-server it starts
//	go run ./cmd/slotbench -out BENCHMARKS.md          # the full run, written as Markdown
//	go run ./cmd/slotbench -scaling -plots docs -out BENCHMARKS.md  # with the scaling runs
//	go run ./cmd/slotbench -redis redis://127.0.0.1:6379/0 -json
//
// On a Redis of your own it writes keys named rate:slotbench-<run>-* and
// slotbench:* and deletes them afterwards.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net/url"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/contention"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if spec := os.Getenv(workerEnv); spec != "" { // a process of a -scaling point
		os.Exit(workerMain(ctx, spec, os.Stdin, os.Stdout, os.Stderr))
	}
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

type options struct {
	redisURL   string
	quick      bool
	out        string
	json       bool
	keys       int
	samples    int
	contention time.Duration
	scale      scaleOptions
	flags      []string // the flags given, as the report records them (setFlags)
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	var o options
	fs := flag.NewFlagSet("slotbench", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.StringVar(&o.redisURL, "redis", "", "Redis URL; default: start a redis-server from PATH on a free loopback port")
	fs.BoolVar(&o.quick, "quick", false, "a CI-sized run: fewer keys and samples")
	fs.StringVar(&o.out, "out", "", "also write the Markdown report to this file")
	fs.BoolVar(&o.json, "json", false, "print the report as JSON instead of Markdown")
	fs.IntVar(&o.keys, "keys", 0, "keys for the memory measurement (default 10000; 2000 with -quick)")
	fs.IntVar(&o.samples, "samples", 0, "calls per latency measurement (default 20000; 3000 with -quick)")
	fs.DurationVar(&o.contention, "contention", 3*time.Second, "how long the contention clients start requests")
	o.scale.register(fs)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fs.SetOutput(stderr)
			fs.Usage()
			return 0
		}
		fmt.Fprintln(stderr, "slotbench:", err)
		return 2
	}
	if o.keys == 0 {
		o.keys = map[bool]int{false: 10_000, true: 2_000}[o.quick]
	}
	if o.samples == 0 {
		o.samples = map[bool]int{false: 20_000, true: 3_000}[o.quick]
	}
	if o.keys < 100 || o.samples < 100 || o.contention <= 0 || fs.NArg() > 0 {
		fmt.Fprintln(stderr, "slotbench: -keys and -samples want at least 100, -contention a positive duration, and no arguments")
		return 2
	}
	if err := o.scale.check(o); err != nil {
		fmt.Fprintln(stderr, "slotbench:", err)
		return 2
	}
	o.flags = setFlags(fs)
	rep, err := bench(ctx, o, stderr)
	if err != nil {
		fmt.Fprintln(stderr, "slotbench:", err)
		return 1
	}
	md := rep.markdown()
	if o.out != "" {
		if err := os.WriteFile(o.out, []byte(md), 0o644); err != nil {
			fmt.Fprintln(stderr, "slotbench:", err)
			return 1
		}
	}
	if o.json {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(rep); err != nil {
			fmt.Fprintln(stderr, "slotbench:", err)
			return 1
		}
		return 0
	}
	fmt.Fprint(stdout, md)
	return 0
}

func bench(ctx context.Context, o options, stderr io.Writer) (*Report, error) {
	var ropts *redis.Options
	if o.redisURL == "" {
		srv, err := redistest.Launch()
		if err != nil {
			return nil, err
		}
		defer srv.Stop()
		ropts = srv.Options()
	} else {
		var err error
		if ropts, err = redis.ParseURL(o.redisURL); err != nil {
			return nil, fmt.Errorf("-redis: %w", err)
		}
		ropts.ContextTimeoutEnabled = true
	}
	rdb := redis.NewClient(ropts)
	defer rdb.Close()
	if err := rdb.Ping(ctx).Err(); err != nil {
		return nil, fmt.Errorf("redis at %s: %w", ropts.Addr, err)
	}
	info, err := rdb.Info(ctx, "server").Result()
	if err != nil {
		return nil, err
	}
	rep := &Report{
		Date: time.Now().UTC().Format("2006-01-02 15:04 MST"), Quick: o.quick, Flags: o.flags,
		Machine: machine(), Go: runtime.Version(), Redis: infoField(info, "redis_version"),
	}
	// The engine's keys get the prefix redis_rate uses, so every strategy
	// keeps the same key names.
	eng, err := newEngine(rdb)
	if err != nil {
		return nil, err
	}
	if err := eng.Load(ctx); err != nil {
		return nil, err
	}
	run := "slotbench-" + strconv.FormatInt(time.Now().UnixNano()%1e9, 36)
	strats := strategies(rdb, eng)

	say := func(format string, a ...any) { fmt.Fprintf(stderr, format+"\n", a...) }
	for i := range strats {
		say("memory: %s, %d keys", strats[i].name, o.keys)
		row, err := func() (MemoryRow, error) {
			if o.redisURL != "" {
				return measureMemory(ctx, rdb, strats[i], run, o.keys)
			}
			// A fresh server for each strategy, so that none pays for
			// another's dictionary growth or connections.
			srv, err := redistest.Launch()
			if err != nil {
				return MemoryRow{}, err
			}
			defer srv.Stop()
			c := redis.NewClient(srv.Options())
			defer c.Close()
			e, err := newEngine(c)
			if err != nil {
				return MemoryRow{}, err
			}
			return measureMemory(ctx, c, strategies(c, e)[i], run, o.keys)
		}()
		if err != nil {
			return nil, fmt.Errorf("memory, %s: %w", strats[i].name, err)
		}
		rep.Memory = append(rep.Memory, row)
	}
	rep.FreshServers = o.redisURL == ""
	// The calls whose cost is measured, interleaved in rounds so that the
	// machine's drift touches each alike.
	var (
		latKeys []string
		probes  []probe
	)
	for i, s := range strats {
		if s.check == nil {
			continue
		}
		key := fmt.Sprintf("%s-lat%d", run, i)
		latKeys = append(latKeys, s.keyOf(key))
		probes = append(probes, probe{name: s.name, command: s.command, call: func(ctx context.Context) error {
			return s.check(ctx, key)
		}})
	}
	open := throttle.PerSecond(1_000_000, 1_000_000)
	latKeys = append(latKeys, "rate:"+run+"-lat-reserve")
	probes = append(probes, probe{name: "slotbook reserve (Book)", command: "evalsha", call: func(ctx context.Context) error {
		_, err := eng.Book(ctx, run+"-lat-reserve", open, throttle.Request{N: 1, MaxWait: time.Second})
		return err
	}})
	lp, stopLease, err := leaseProbe(ctx, ropts, eng, run) // lease.go
	if err != nil {
		return nil, fmt.Errorf("lease: %w", err)
	}
	defer stopLease()
	latKeys = append(latKeys, "rate:"+run+"-lease:{lat}:lease:c")
	probes = append(probes, lp)
	latKeys = append(latKeys, run+"-lat-floor")
	probes = append(probes,
		probe{name: "reference: EVALSHA of an empty script", command: "evalsha", call: func(ctx context.Context) error {
			return emptyScript.Run(ctx, rdb, nil).Err()
		}},
		probe{name: "reference: a script doing only TIME, GET, SET PX", command: "evalsha", call: func(ctx context.Context) error {
			return floorScript.Run(ctx, rdb, []string{run + "-lat-floor"}).Err()
		}},
		probe{name: "reference: the same with slotbook's 4 arguments and book1.lua's reply", command: "evalsha", call: func(ctx context.Context) error {
			// book1.lua's arguments for a reservation: the clock, n*I, tau+I, max wait.
			return protocolFloorScript.Run(ctx, rdb, []string{run + "-lat-floor"}, "", 1, 1_000_001, 1_000_000).Err()
		}},
		probe{name: "reference: the same, storing the Redis time in microseconds as an integer", command: "evalsha", call: func(ctx context.Context) error {
			return integerFloorScript.Run(ctx, rdb, []string{run + "-lat-floor"}, "", 1, 1_000_001, 1_000_000).Err()
		}})
	say("latency: %d kinds of call, %d each, in %d interleaved rounds", len(probes), o.samples, latencyRounds(o.samples))
	if rep.Latency, err = measureLatency(ctx, rdb, probes, o.samples, latencyRounds(o.samples)); err != nil {
		return nil, err
	}
	_ = rdb.Del(ctx, latKeys...).Err()

	say("contention: 20 clients, 10/s burst 5, %v, three modes one after another", o.contention)
	if rep.Contention, err = measureContention(ctx, ropts, run, o.contention); err != nil {
		return nil, err
	}
	rep.ContentionSeconds = o.contention.Seconds()
	say("coalescing: 64 goroutines on one key")
	if rep.Coalescing, err = measureCoalescing(ctx, ropts, run, map[bool]int{false: 50_000, true: 10_000}[o.quick]); err != nil {
		return nil, err
	}
	if o.scale.on {
		if rep.Scaling, err = measureScaling(ctx, o, say); err != nil {
			return nil, err
		}
		rep.Scaling.linkBase = filepath.Dir(o.out)
	}
	rep.judge()
	return rep, nil
}

// MemoryRow is one strategy's memory per key.
type MemoryRow struct {
	Name string `json:"name"`
	Keys int    `json:"keys"`
	// InfoPerKey is the INFO used_memory delta over the fill, less the
	// client connections' memory (see measureMemory), per key.
	InfoPerKey  float64 `json:"info_bytes_per_key"`
	UsagePerKey float64 `json:"usage_bytes_per_key"` // mean MEMORY USAGE over a sample
}

func measureMemory(ctx context.Context, rdb *redis.Client, s strategy, run string, keys int) (MemoryRow, error) {
	names := make([]string, keys)
	for i := range names {
		names[i] = fmt.Sprintf("%s-k%06d", run, i)
	}
	del := func() error {
		for i := 0; i < keys; i += 500 {
			var batch []string
			for _, n := range names[i:min(i+500, keys)] {
				batch = append(batch, s.keyOf(n))
			}
			if err := rdb.Unlink(ctx, batch...).Err(); err != nil {
				return err
			}
		}
		return nil
	}
	defer del()
	// The fill goes through a client of its own (s.on), whose connections
	// are opened after the first reading and closed before the second:
	// their buffers (some 20 KB each while in use) are not the keys'
	// memory. Both readings also take every client connection's memory out
	// of used_memory (serverMemory): the one they are made on, and on a
	// Redis given with -redis other clients'.
	o := *rdb.Options()
	side := func() (strategy, *redis.Client, func(), error) {
		if s.on == nil {
			return s, rdb, func() {}, nil
		}
		c := redis.NewClient(&o)
		st, err := s.on(c)
		if err != nil {
			_ = c.Close()
			return strategy{}, nil, nil, err
		}
		return st, c, func() { _ = c.Close() }, nil
	}
	n0, _, err := clientsMemory(ctx, rdb)
	if err != nil {
		return MemoryRow{}, err
	}
	// Warm up as the fill will go, on keys of its own, so that nothing
	// that stays is made during the fill but the keys: the strategy's
	// scripts in the server's cache, and a latency histogram (24 KB in
	// Redis 7) for each command the server runs for the first time,
	// connecting (HELLO), inside the scripts, and the readings' INFO and
	// CLIENT LIST.
	warm, wc, closeWarm, err := side()
	if err != nil {
		return MemoryRow{}, err
	}
	warmKeys := make([]string, 64)
	err = func() error {
		defer closeWarm()
		if warm.load != nil {
			if err := warm.load(ctx); err != nil {
				return err
			}
		}
		if err := parallel(ctx, 16, len(warmKeys), func(ctx context.Context, i int) error {
			warmKeys[i] = s.keyOf(fmt.Sprintf("%s-warmup%02d", run, i))
			return warm.fill(ctx, fmt.Sprintf("%s-warmup%02d", run, i))
		}); err != nil {
			return err
		}
		if err := wc.Info(ctx, "memory").Err(); err != nil {
			return err
		}
		_, _, err := clientsMemory(ctx, wc)
		return err
	}()
	if err != nil {
		return MemoryRow{}, err
	}
	if err := rdb.Unlink(ctx, warmKeys...).Err(); err != nil {
		return MemoryRow{}, err
	}
	if err := untilClients(ctx, rdb, n0); err != nil {
		return MemoryRow{}, err
	}
	fill, _, closeFill, err := side()
	if err != nil {
		return MemoryRow{}, err
	}
	defer closeFill()
	before, err := serverMemory(ctx, rdb)
	if err != nil {
		return MemoryRow{}, err
	}
	if err := parallel(ctx, 16, keys, func(ctx context.Context, i int) error { return fill.fill(ctx, names[i]) }); err != nil {
		return MemoryRow{}, err
	}
	closeFill()
	if err := untilClients(ctx, rdb, before.clients); err != nil {
		return MemoryRow{}, err
	}
	after, err := serverMemory(ctx, rdb)
	if err != nil {
		return MemoryRow{}, err
	}
	var usage int64
	sample := min(keys, 500)
	for i := 0; i < sample; i++ {
		u, err := rdb.MemoryUsage(ctx, s.keyOf(names[i*keys/sample]), 0).Result()
		if err != nil {
			return MemoryRow{}, err
		}
		usage += u
	}
	return MemoryRow{Name: s.name, Keys: keys, InfoPerKey: float64(after.keysMem()-before.keysMem()) / float64(keys),
		UsagePerKey: float64(usage) / float64(sample)}, nil
}

// LatencyRow is one kind of call's cost, next to PING in the same run.
type LatencyRow struct {
	Name    string        `json:"name"`
	P50     time.Duration `json:"p50_ns"`
	P99     time.Duration `json:"p99_ns"`
	PingP50 time.Duration `json:"ping_p50_ns"`
	PingP99 time.Duration `json:"ping_p99_ns"`
	// UsecPerCall is the server's time per timed call, from INFO
	// commandstats (the median over rounds): the time of every script the
	// call sent (the lease row's call is two, Acquire's and Release's), in
	// the same unit as P50.
	UsecPerCall float64 `json:"server_usec_per_call"`
	// ScriptsPerCall is the probe's command (EVALSHA) counted by the server
	// per timed call, over all rounds.
	ScriptsPerCall float64 `json:"scripts_per_call"`
}

// latencyRounds is how many rounds measureLatency splits n calls of each
// probe into: rounds of 100 calls (at least 10 rounds). Short rounds, many
// of them, so that a stretch of time the server loses to other processes
// (on a busy machine) falls into few of them, and the median over rounds
// passes it by.
func latencyRounds(n int) int { return max(10, n/100) }

// probe is one kind of call to time.
type probe struct {
	name, command string
	call          func(context.Context) error
}

// measureLatency times n calls of each probe, each call after a PING, in
// rounds: every round runs n/rounds calls of each probe in turn. The
// server's CPU per call comes from the INFO commandstats deltas of each
// probe's own phases: the median over the rounds of each round's
// microseconds of the probe's command over its timed calls, so that a call
// sending two scripts (a lease: Acquire, then Release) is charged both, as
// its p50 is. (A mean over all calls is at the mercy of the
// one round in which the machine took the server's core away: commandstats
// times each command by the clock, not by CPU.)
func measureLatency(ctx context.Context, rdb *redis.Client, probes []probe, n, rounds int) ([]LatencyRow, error) {
	type acc struct {
		took, ping []time.Duration
		perCall    []float64 // server µs per timed call, one per round
		scripts    int64     // the probe's command, as the server counted it
	}
	accs := make([]acc, len(probes))
	for _, p := range probes { // warm up: connections, script cache
		for i := 0; i < 200; i++ {
			if err := p.call(ctx); err != nil {
				return nil, fmt.Errorf("%s: %w", p.name, err)
			}
		}
	}
	per := max(1, n/rounds)
	for r := 0; r < rounds; r++ {
		for k, p := range probes {
			calls0, usec0, err := commandStats(ctx, rdb, p.command)
			if err != nil {
				return nil, err
			}
			for i := 0; i < per; i++ {
				t := time.Now()
				if err := rdb.Ping(ctx).Err(); err != nil {
					return nil, err
				}
				accs[k].ping = append(accs[k].ping, time.Since(t))
				t = time.Now()
				if err := p.call(ctx); err != nil {
					return nil, fmt.Errorf("%s: %w", p.name, err)
				}
				accs[k].took = append(accs[k].took, time.Since(t))
			}
			calls1, usec1, err := commandStats(ctx, rdb, p.command)
			if err != nil {
				return nil, err
			}
			if calls1 > calls0 {
				accs[k].perCall = append(accs[k].perCall, float64(usec1-usec0)/float64(per))
				accs[k].scripts += calls1 - calls0
			}
		}
	}
	rows := make([]LatencyRow, len(probes))
	for k, p := range probes {
		rows[k].Name = p.name
		rows[k].P50, rows[k].P99 = percentiles(accs[k].took)
		rows[k].PingP50, rows[k].PingP99 = percentiles(accs[k].ping)
		if pc := accs[k].perCall; len(pc) > 0 {
			slices.Sort(pc)
			rows[k].UsecPerCall = pc[len(pc)/2]
			rows[k].ScriptsPerCall = float64(accs[k].scripts) / float64(len(pc)*per)
		}
	}
	return rows, nil
}

// percentiles returns the nearest-rank p50 and p99 of d: the
// nearestRank(n, q)-th smallest of its n values, as latencyHist's
// quantile counts them.
func percentiles(d []time.Duration) (p50, p99 time.Duration) {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[nearestRank(int64(len(s)), 0.50)-1], s[nearestRank(int64(len(s)), 0.99)-1]
}

// nearestRank is the rank (from 1) of the q-quantile of n sorted values
// by the nearest-rank definition: ceil(q*n), at least 1. The p99 of 100
// values is the 99th, not the largest.
func nearestRank(n int64, q float64) int64 {
	// The product is rounded first, so that q*n a hair above a whole
	// number in floating point (0.29*100) does not take the rank above.
	return max(1, int64(math.Ceil(math.Round(q*float64(n)*1e9)/1e9)))
}

// The contention runs' setting: 20 clients share a limit of 10/s burst 5,
// and the reservation modes wait up to 2 s for a slot.
var (
	contentionLimit   = throttle.PerSecond(10, 5)
	contentionMaxWait = 2 * time.Second
)

func measureContention(ctx context.Context, ropts *redis.Options, run string, d time.Duration) ([]contention.Result, error) {
	limit := contentionLimit
	var out []contention.Result
	for _, mode := range contention.Modes {
		rdb := redis.NewClient(ropts)
		calls := callcount.Attach(rdb)
		eng, err := throttle.New(rdb, throttle.WithPrefix("slotbench:"+run+":"), throttle.WithTimeout(5*time.Second))
		if err == nil {
			err = eng.Load(ctx)
		}
		var lim *reserve.Limiter
		if err == nil {
			// One client per process, as in the published experiment.
			lim, err = reserve.New(eng, "contention", limit, reserve.WithMaxWait(contentionMaxWait), reserve.WithCoalescing(false))
		}
		if err != nil {
			rdb.Close()
			return nil, err
		}
		cfg := contention.Config{Clients: 20, Limit: limit, Duration: d, MaxWait: contentionMaxWait, Calls: calls.Load}
		res, err := contention.Run(ctx, mode, lim, mode, cfg)
		rdb.Close()
		if err != nil {
			return nil, err
		}
		res.Starts = nil // not for the report
		out = append(out, res)
	}
	return out, nil
}

// CoalescingRow is reservations per second from 64 goroutines on one key,
// coalesced and not.
//
// Uncoalesced callers are measured twice: as a default client runs them,
// where the engine merges single bookings that find every connection busy
// or four bookings in flight (throttle.WithMerging, WithMergeAt), and with
// merging off, one call per reservation.
// Speedup, which the target judges, is against the latter: what coalescing
// saves over calling Redis for each reservation.
type CoalescingRow struct {
	Reservations        int     `json:"reservations"`
	CoalescedPerSec     float64 `json:"coalesced_per_sec"`
	UncoalescedPerSec   float64 `json:"uncoalesced_per_sec"`
	Speedup             float64 `json:"speedup"`
	CallsPerReservation float64 `json:"coalesced_calls_per_reservation"`
	// UncoalescedCalls: Redis calls per reservation of the uncoalesced
	// callers, merged.
	UncoalescedCalls float64 `json:"uncoalesced_calls_per_reservation"`
	// Alone: the uncoalesced callers with merging off.
	AlonePerSec float64 `json:"alone_per_sec"`
	AloneCalls  float64 `json:"alone_calls_per_reservation"`
}

func measureCoalescing(ctx context.Context, ropts *redis.Options, run string, total int) (CoalescingRow, error) {
	rdb := redis.NewClient(ropts)
	defer rdb.Close()
	calls := callcount.Attach(rdb)
	eng, err := throttle.New(rdb, throttle.WithPrefix("slotbench:"+run+":"), throttle.WithTimeout(5*time.Second))
	if err != nil {
		return CoalescingRow{}, err
	}
	if err := eng.Load(ctx); err != nil {
		return CoalescingRow{}, err
	}
	alone, err := throttle.New(rdb, throttle.WithPrefix("slotbench:"+run+":"), throttle.WithTimeout(5*time.Second), throttle.WithMerging(false))
	if err != nil {
		return CoalescingRow{}, err
	}
	open := throttle.PerSecond(1_000_000, 1_000_000)
	rate := func(eng *throttle.Engine, coalesce bool) (float64, float64, error) {
		lim, err := reserve.New(eng, "coalesce", open, reserve.WithCoalescing(coalesce))
		if err != nil {
			return 0, 0, err
		}
		return contention.Throughput(ctx, lim, "k", 64, total, calls.Load)
	}
	row := CoalescingRow{Reservations: total}
	if row.CoalescedPerSec, row.CallsPerReservation, err = rate(eng, true); err != nil {
		return CoalescingRow{}, err
	}
	if row.UncoalescedPerSec, row.UncoalescedCalls, err = rate(eng, false); err != nil {
		return CoalescingRow{}, err
	}
	if row.AlonePerSec, row.AloneCalls, err = rate(alone, false); err != nil {
		return CoalescingRow{}, err
	}
	row.Speedup = row.CoalescedPerSec / row.AlonePerSec
	return row, nil
}

// parallel runs f for 0..n-1 on workers goroutines.
func parallel(ctx context.Context, workers, n int, f func(context.Context, int) error) error {
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex // guards next and first
		next  int
		first error
	)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				mu.Lock()
				i := next
				next++
				stop := first != nil
				mu.Unlock()
				if i >= n || stop {
					return
				}
				if err := f(ctx, i); err != nil {
					mu.Lock()
					first = cmp(first, err)
					mu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	return first
}

func cmp(a, b error) error {
	if a != nil {
		return a
	}
	return b
}

// memReading is a server's memory at one moment.
type memReading struct {
	used       int64 // INFO used_memory
	clients    int   // client connections, by CLIENT LIST
	clientsMem int64 // their memory: the sum of CLIENT LIST's tot-mem
}

// keysMem is used_memory less the client connections' memory.
func (m memReading) keysMem() int64 { return m.used - m.clientsMem }

// serverMemory reads used_memory and the client connections' memory.
// Their memory comes from CLIENT LIST, which works it out as it answers:
// INFO's mem_clients_normal is a sum the server brings up to date a client
// at a time in its cron (Redis 7.0: 0 just after 16 connections opened,
// 564,480 bytes 300 ms later), so taking it out would take out a different
// moment's figure.
func serverMemory(ctx context.Context, rdb *redis.Client) (memReading, error) {
	info, err := rdb.Info(ctx, "memory").Result()
	if err != nil {
		return memReading{}, err
	}
	used, err := strconv.ParseInt(infoField(info, "used_memory"), 10, 64)
	if err != nil {
		return memReading{}, fmt.Errorf("INFO memory used_memory: %w", err)
	}
	n, mem, err := clientsMemory(ctx, rdb)
	return memReading{used: used, clients: n, clientsMem: mem}, err
}

// untilClients waits until the server lists at most n client connections
// (it frees a closed connection's client once it reads the close), for 2 s
// at most: on a Redis given with -redis other clients may come, and their
// memory is taken out of the readings all the same.
func untilClients(ctx context.Context, rdb *redis.Client, n int) error {
	for deadline := time.Now().Add(2 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		have, _, err := clientsMemory(ctx, rdb)
		if err != nil || have <= n || time.Now().After(deadline) {
			return err
		}
	}
}

// clientsMemory returns the client connections CLIENT LIST lists and the
// sum of their tot-mem (Redis 6.2 and later).
func clientsMemory(ctx context.Context, rdb *redis.Client) (n int, mem int64, err error) {
	list, err := rdb.ClientList(ctx).Result()
	if err != nil {
		return 0, 0, err
	}
	for _, line := range strings.Split(strings.TrimSpace(list), "\n") {
		found := false
		for _, f := range strings.Fields(line) {
			if v, ok := strings.CutPrefix(f, "tot-mem="); ok {
				m, err := strconv.ParseInt(v, 10, 64)
				if err != nil {
					return 0, 0, fmt.Errorf("CLIENT LIST tot-mem %q: %w", v, err)
				}
				mem += m
				found = true
			}
		}
		if !found {
			return 0, 0, fmt.Errorf("CLIENT LIST gives no tot-mem (Redis 6.2 or later needed): %q", line)
		}
		n++
	}
	return n, mem, nil
}

// commandStats returns the calls and microseconds INFO commandstats
// reports for command so far.
func commandStats(ctx context.Context, rdb *redis.Client, command string) (calls, usec int64, err error) {
	info, err := rdb.Info(ctx, "commandstats").Result()
	if err != nil {
		return 0, 0, err
	}
	line := infoField(info, "cmdstat_"+command)
	for _, kv := range strings.Split(line, ",") {
		k, v, _ := strings.Cut(kv, "=")
		switch k {
		case "calls":
			calls, _ = strconv.ParseInt(v, 10, 64)
		case "usec":
			usec, _ = strconv.ParseInt(v, 10, 64)
		}
	}
	return calls, usec, nil
}

// setFlags returns the flags given on fs's command line, as a shell would
// take them back, in name order: a password in -redis's URL is redacted.
func setFlags(fs *flag.FlagSet) []string {
	var out []string
	fs.Visit(func(f *flag.Flag) {
		v := f.Value.String()
		if f.Name == "redis" {
			if u, err := url.Parse(v); err == nil {
				v = u.Redacted()
			}
		}
		if b, ok := f.Value.(interface{ IsBoolFlag() bool }); ok && b.IsBoolFlag() {
			if v == "true" {
				out = append(out, "-"+f.Name)
			} else {
				out = append(out, "-"+f.Name+"="+v) // a bool flag takes no separate value
			}
			return
		}
		out = append(out, "-"+f.Name, shellWord(v))
	})
	return out
}

// shellWord is s quoted for a POSIX shell where it needs to be.
func shellWord(s string) string {
	if s != "" && strings.Trim(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./:,=@+%") == "" {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

func infoField(info, field string) string {
	sc := bufio.NewScanner(strings.NewReader(info))
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), field+":"); ok {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

func machine() string {
	model := "unknown CPU"
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		if v := infoField(strings.ReplaceAll(string(b), "\t", ""), "model name"); v != "" {
			model = strings.TrimSpace(v)
		}
	}
	return fmt.Sprintf("%s, %d cores (GOMAXPROCS %d), %s/%s", model, runtime.NumCPU(), runtime.GOMAXPROCS(0), runtime.GOOS, runtime.GOARCH)
}
