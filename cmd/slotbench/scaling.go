package main

// How cost grows with keys, clients and processes (-scaling): granted
// requests per second (a request is granted when it is let through at
// once: see load.op), Redis calls and server CPU per granted request, and
// booking latency, for slotbook's reservation (coalesced and not), its pool
// and go-redis/redis_rate's Allow doing the same work, each point on a
// fresh redis-server; the same on a 3-master Redis Cluster, per node; and
// memory per key at growing key counts.

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/go-redis/redis_rate/v10"
	"github.com/redis/go-redis/v9"

	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/pool"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// The strategies of the scaling runs, in the order they are shown.
const (
	stratCoalesced   = "slotbook reserve, coalesced"
	stratUncoalesced = "slotbook reserve, uncoalesced"
	stratPool        = "slotbook pool"
	stratRedisRate   = "redis_rate Allow"
)

var scaleStrategies = []string{stratCoalesced, stratUncoalesced, stratPool, stratRedisRate}

// workerEnv, when set in a process's environment, makes slotbench a load
// worker of a multi-process point: the variable holds the loadSpec as JSON.
const workerEnv = "SLOTBENCH_WORKER"

// intList is a flag of comma-separated positive integers.
type intList []int

func (l *intList) String() string {
	s := make([]string, len(*l))
	for i, v := range *l {
		s[i] = strconv.Itoa(v)
	}
	return strings.Join(s, ",")
}

func (l *intList) Set(v string) error {
	var out intList
	for _, f := range strings.Split(v, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n <= 0 {
			return fmt.Errorf("%q: want comma-separated positive integers", v)
		}
		out = append(out, n)
	}
	*l = out
	return nil
}

// scaleOptions are the -scaling run's flags.
type scaleOptions struct {
	on                bool
	dur               time.Duration
	goroutines        intList
	procs             intList
	keys              intList
	memKeys           intList
	cluster           bool
	clusterGoroutines intList
	rounds            int
	plots             string
}

func (s *scaleOptions) register(fs *flag.FlagSet) {
	s.goroutines = intList{1, 4, 16, 64, 256}
	s.procs = intList{1, 4}
	s.keys = intList{1, 10_000}
	s.memKeys = intList{10_000, 100_000, 1_000_000}
	s.clusterGoroutines = intList{64}
	fs.BoolVar(&s.on, "scaling", false, "also measure how cost grows with keys, clients and processes (fresh redis-servers; not with -redis)")
	fs.DurationVar(&s.dur, "scaling-time", 2*time.Second, "how long each scaling point runs, in all its rounds together")
	fs.IntVar(&s.rounds, "scaling-rounds", 4, "rounds each scaling point's time is split into, the strategies taking turns")
	fs.Var(&s.goroutines, "scaling-goroutines", "client goroutines of the scaling points, in all processes together")
	fs.Var(&s.procs, "scaling-procs", "processes of the scaling points (more than one: slotbench re-executes itself)")
	fs.Var(&s.keys, "scaling-keys", "keys the scaling points spread their requests over")
	fs.Var(&s.memKeys, "scaling-memory", "key counts of the memory-per-key-at-scale measurement")
	fs.BoolVar(&s.cluster, "scaling-cluster", true, "with -scaling, also run on a 3-master Redis Cluster (needs redis-cli)")
	fs.Var(&s.clusterGoroutines, "scaling-cluster-goroutines", "client goroutines of the cluster points")
	fs.StringVar(&s.plots, "plots", "", "with -scaling, write the scaling curves as PNG files into this directory")
}

func (s *scaleOptions) check(o options) error {
	if !s.on {
		return nil
	}
	if o.redisURL != "" {
		return errors.New("-scaling measures server CPU on redis-servers of its own: leave out -redis")
	}
	if s.dur <= 0 || s.rounds <= 0 {
		return errors.New("-scaling-time wants a positive duration, -scaling-rounds a positive count")
	}
	return nil
}

// ScalingReport is the -scaling section of a run.
type ScalingReport struct {
	Seconds float64      `json:"seconds_per_point"`
	Limit   string       `json:"limit"`   // the limit every point runs under (openLimit), never to be reached
	Rounds  int          `json:"rounds"`  // each point's time is split into rounds, the strategies taking turns
	Points  []ScalePoint `json:"points"`  // a fresh redis-server for each keys, procs and goroutines
	Cluster []ScalePoint `json:"cluster"` // a 3-master Redis Cluster
	Memory  []MemoryRow  `json:"memory"`  // memory per key at growing key counts
	Plots   []string     `json:"plots,omitempty"`
	// linkBase is the directory the Markdown report is written to, which
	// its links to the plots are relative to.
	linkBase string
}

// ScalePoint is one strategy at one number of keys, processes and
// goroutines.
type ScalePoint struct {
	Strategy   string `json:"strategy"`
	Keys       int    `json:"keys"`
	Procs      int    `json:"procs"`
	Goroutines int    `json:"goroutines"`
	// Granted is the requests let through at once (see load.op); NotAtOnce
	// those that were not: a reservation booked for a later slot, a pool
	// job that waited for one, a redis_rate request refused. Any of the
	// latter means the point reached the limit, which the scaling runs
	// assume it never does.
	Granted    int64   `json:"granted"`
	NotAtOnce  int64   `json:"not_at_once"`
	Errors     int64   `json:"errors"`
	FirstError string  `json:"first_error,omitempty"`
	Seconds    float64 `json:"seconds"`
	PerSec     float64 `json:"granted_per_sec"`
	Calls      int64   `json:"redis_calls"`
	// CallsPerGranted is Redis round trips per granted request, as the
	// clients counted them.
	CallsPerGranted float64 `json:"calls_per_granted"`
	// CPUPerGranted is the servers' CPU (used_cpu_sys + used_cpu_user
	// deltas) per granted request, in µs; CmdPerGranted the time INFO
	// commandstats gives the scripts the clients sent (EVALSHA, EVAL:
	// clientCommands), the commands those scripts run included once, per
	// granted request: the servers' time running commands, no I/O. It is
	// wall-clock time, so on a busy machine it may exceed the CPU.
	CPUPerGranted float64 `json:"server_cpu_usec_per_granted"`
	CmdPerGranted float64 `json:"command_usec_per_granted"`
	// ClientCPUPerGranted is the client processes' CPU (user + system,
	// getrusage) per granted request, in µs.
	ClientCPUPerGranted float64       `json:"client_cpu_usec_per_granted"`
	P50                 time.Duration `json:"p50_ns"`
	P99                 time.Duration `json:"p99_ns"`
	Nodes               []NodeStat    `json:"nodes,omitempty"`
	// RoundPerSec is the granted requests per second of each round, in
	// the order the rounds ran (0 for a round that did not run): every
	// round runs each strategy once, one after another, so the ratio of
	// two strategies' rates in the same round is a paired comparison (see
	// roundSpread).
	RoundPerSec []float64 `json:"round_granted_per_sec,omitempty"`
}

// NodeStat is one Redis Cluster master's share of a cluster point.
type NodeStat struct {
	Addr          string  `json:"addr"`
	Keys          int64   `json:"keys"`    // the point's keys whose state the cluster's slot map puts on this master (MasterForKey), not DBSIZE
	Granted       int64   `json:"granted"` // granted requests whose key it holds
	CPUPerGranted float64 `json:"server_cpu_usec_per_granted"`
}

func measureScaling(ctx context.Context, o options, say func(string, ...any)) (*ScalingReport, error) {
	s := o.scale
	rep := &ScalingReport{Seconds: s.dur.Seconds(), Limit: openLimit.String(), Rounds: s.rounds}
	run := "sb" + strconv.FormatInt(time.Now().UnixNano()%1e9, 36)
	for _, keys := range s.keys {
		for _, procs := range s.procs {
			for _, g := range s.goroutines {
				if g < procs {
					continue
				}
				say("scaling: %d keys, %d processes, %d goroutines: %d strategies in %d interleaved rounds", keys, procs, g, len(scaleStrategies), s.rounds)
				points, err := singleGroup(ctx, loadSpec{Keys: keys, Goroutines: g / procs, Prefix: run + ":", Duration: s.dur / time.Duration(s.rounds)}, procs, s.rounds)
				if err != nil {
					return nil, fmt.Errorf("scaling, %d keys, %d processes, %d goroutines: %w", keys, procs, g, err)
				}
				rep.Points = append(rep.Points, points...)
			}
		}
	}
	if s.cluster && len(s.clusterGoroutines) > 0 {
		say("scaling: starting a 3-master Redis Cluster")
		cl, err := launchCluster(3)
		if err != nil {
			return nil, fmt.Errorf("cluster: %w", err)
		}
		defer cl.stop()
		for _, keys := range s.keys {
			for _, g := range s.clusterGoroutines {
				say("scaling, cluster: %d keys, %d goroutines", keys, g)
				spec := loadSpec{Addrs: cl.addrs, Cluster: true, Keys: keys, Goroutines: g, Prefix: run + ":", Duration: s.dur / time.Duration(s.rounds)}
				points, err := clusterGroup(ctx, cl, spec, s.rounds)
				if err != nil {
					return nil, fmt.Errorf("cluster, %d keys, %d goroutines: %w", keys, g, err)
				}
				rep.Cluster = append(rep.Cluster, points...)
			}
		}
	}
	for _, n := range s.memKeys {
		for _, i := range []int{0, 1, 4} { // slotbook, redis_rate, the floor
			row, err := func() (MemoryRow, error) {
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
				st := strategies(c, e)[i]
				say("memory at scale: %s, %d keys", st.name, n)
				return measureMemory(ctx, c, st, run, n)
			}()
			if err != nil {
				return nil, fmt.Errorf("memory at %d keys: %w", n, err)
			}
			rep.Memory = append(rep.Memory, row)
		}
	}
	if s.plots != "" {
		files, err := writeScalingPlots(s.plots, rep)
		if err != nil {
			return nil, fmt.Errorf("-plots: %w", err)
		}
		rep.Plots = files
	}
	return rep, nil
}

// singleGroup runs every strategy at spec's keys and goroutines from
// procs processes against one fresh redis-server, the strategies taking
// turns in rounds (each round in a different order) so that the machine's
// drift touches each alike.
func singleGroup(ctx context.Context, spec loadSpec, procs, rounds int) ([]ScalePoint, error) {
	srv, err := redistest.Launch()
	if err != nil {
		return nil, err
	}
	defer srv.Stop()
	spec.Addrs = []string{srv.Addr}
	admin := redis.NewClient(srv.Options())
	defer admin.Close()
	accs, err := interleave(ctx, spec, procs, rounds, []*redis.Client{admin})
	if err != nil {
		return nil, err
	}
	points := make([]ScalePoint, len(accs))
	for i, a := range accs {
		points[i] = a.point()
	}
	return points, nil
}

// clusterGroup is singleGroup from one process on the cluster, emptied
// first, with each master's share.
func clusterGroup(ctx context.Context, cl *cluster, spec loadSpec, rounds int) ([]ScalePoint, error) {
	admins := make([]*redis.Client, len(cl.addrs))
	for i, a := range cl.addrs {
		admins[i] = redis.NewClient(&redis.Options{Addr: a})
		defer admins[i].Close()
		if err := admins[i].FlushAll(ctx).Err(); err != nil {
			return nil, err
		}
	}
	accs, err := interleave(ctx, spec, 1, rounds, admins)
	if err != nil {
		return nil, err
	}
	points := make([]ScalePoint, len(accs))
	for i, a := range accs {
		p := a.point()
		for n, addr := range cl.addrs {
			ns := NodeStat{Addr: addr, Keys: a.nodeKeys[addr], Granted: a.perNode[addr]}
			if ns.Granted > 0 {
				ns.CPUPerGranted = a.srv[n].cpuUsec / float64(ns.Granted)
			}
			p.Nodes = append(p.Nodes, ns)
		}
		points[i] = p
	}
	return points, nil
}

// accum adds up one strategy's rounds.
type accum struct {
	spec     loadSpec
	procs    int
	granted  int64
	later    int64 // not let through at once
	errors   int64
	first    string
	calls    int64
	client   time.Duration // client processes' CPU
	seconds  float64
	hist     latencyHist
	perNode  map[string]int64
	nodeKeys map[string]int64
	srv      []serverStats // per server
	rates    []float64     // granted per second, per round
}

func (a *accum) add(results []loadResult, srv []serverStats) {
	var longest time.Duration
	var granted int64
	for _, r := range results {
		granted += r.Granted
		a.granted += r.Granted
		a.later += r.NotAtOnce
		a.errors += r.Errors
		a.calls += r.Calls
		a.client += r.ClientCPU
		longest = max(longest, r.Elapsed)
		if a.first == "" {
			a.first = r.FirstError
		}
		a.hist.merge(r.Hist)
		for n, c := range r.PerNode {
			if a.perNode == nil {
				a.perNode = make(map[string]int64)
			}
			a.perNode[n] += c
		}
		if r.NodeKeys != nil {
			a.nodeKeys = r.NodeKeys // the same in every round and process
		}
	}
	a.seconds += longest.Seconds()
	rate := 0.0 // kept, so that round i stays at index i (roundSpread pairs them)
	if longest > 0 {
		rate = float64(granted) / longest.Seconds()
	}
	a.rates = append(a.rates, rate)
	if a.srv == nil {
		a.srv = make([]serverStats, len(srv))
	}
	for i := range srv {
		a.srv[i] = a.srv[i].add(srv[i])
	}
}

func (a *accum) point() ScalePoint {
	p := ScalePoint{Strategy: a.spec.Strategy, Keys: a.spec.Keys, Procs: a.procs, Goroutines: a.spec.Goroutines * a.procs,
		Granted: a.granted, NotAtOnce: a.later, Errors: a.errors, FirstError: a.first, Calls: a.calls, Seconds: a.seconds, RoundPerSec: a.rates}
	var srv serverStats
	for _, s := range a.srv {
		srv = srv.add(s)
	}
	if p.Seconds > 0 {
		p.PerSec = float64(p.Granted) / p.Seconds
	}
	if p.Granted > 0 {
		g := float64(p.Granted)
		p.CallsPerGranted = float64(p.Calls) / g
		p.CPUPerGranted = srv.cpuUsec / g
		p.CmdPerGranted = float64(srv.cmdUsec) / g
		p.ClientCPUPerGranted = float64(a.client) / float64(time.Microsecond) / g
	}
	p.P50, p.P99 = a.hist.quantile(0.50), a.hist.quantile(0.99)
	return p
}

// interleave prepares every strategy at spec in procs processes, then runs
// rounds rounds, in each of which every strategy runs once for spec's
// duration, in an order that turns from round to round; the servers'
// statistics are read before and after each run.
func interleave(ctx context.Context, spec loadSpec, procs, rounds int, admins []*redis.Client) ([]*accum, error) {
	runners := make([]runner, len(scaleStrategies))
	defer func() {
		for _, r := range runners {
			if r != nil {
				r.close()
			}
		}
	}()
	accs := make([]*accum, len(scaleStrategies))
	for i, strat := range scaleStrategies {
		sp := spec
		sp.Strategy = strat
		r, err := startRunner(ctx, sp, procs)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", strat, err)
		}
		runners[i] = r
		accs[i] = &accum{spec: sp, procs: procs}
	}
	snap := func() ([]serverStats, error) {
		out := make([]serverStats, len(admins))
		for i, a := range admins {
			s, err := snapshot(ctx, a)
			if err != nil {
				return nil, err
			}
			out[i] = s
		}
		return out, nil
	}
	for r := 0; r < rounds; r++ {
		for k := range scaleStrategies {
			i := (k + r) % len(scaleStrategies)
			before, err := snap()
			if err != nil {
				return nil, err
			}
			results, err := runners[i].round(ctx)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", scaleStrategies[i], err)
			}
			after, err := snap()
			if err != nil {
				return nil, err
			}
			for n := range after {
				after[n] = after[n].sub(before[n])
			}
			accs[i].add(results, after)
		}
	}
	return accs, nil
}

// A runner is one strategy's load, prepared in one or more processes,
// run a round at a time.
type runner interface {
	round(ctx context.Context) ([]loadResult, error)
	close()
}

// startRunner prepares spec in this process (procs 1) or in procs
// re-executed copies of this program, each of which says "ready" once
// connected and warmed up, runs a round on each "go" it reads, printing
// its result, and exits when its standard input closes.
func startRunner(ctx context.Context, spec loadSpec, procs int) (runner, error) {
	if procs == 1 {
		l, err := prepareLoad(ctx, spec)
		if err != nil {
			return nil, err
		}
		return localRunner{l}, nil
	}
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	js, err := json.Marshal(spec)
	if err != nil {
		return nil, err
	}
	rr := &remoteRunner{}
	for i := 0; i < procs; i++ {
		cmd := exec.CommandContext(ctx, exe)
		cmd.Env = append(os.Environ(), workerEnv+"="+string(js))
		cmd.Stderr = os.Stderr
		in, err := cmd.StdinPipe()
		if err != nil {
			rr.close()
			return nil, err
		}
		out, err := cmd.StdoutPipe()
		if err != nil {
			rr.close()
			return nil, err
		}
		if err := cmd.Start(); err != nil {
			rr.close()
			return nil, err
		}
		rr.ws = append(rr.ws, worker{cmd: cmd, in: in, out: bufio.NewReader(out)})
	}
	for i, w := range rr.ws {
		line, err := w.out.ReadString('\n')
		if err != nil || strings.TrimSpace(line) != "ready" {
			rr.close()
			return nil, fmt.Errorf("worker %d: not ready: %q %v", i, line, err)
		}
	}
	return rr, nil
}

type localRunner struct{ l *load }

func (r localRunner) round(ctx context.Context) ([]loadResult, error) {
	return []loadResult{r.l.run(ctx)}, nil
}

func (r localRunner) close() { r.l.close() }

type worker struct {
	cmd *exec.Cmd
	in  io.WriteCloser
	out *bufio.Reader
}

type remoteRunner struct{ ws []worker }

func (r *remoteRunner) round(ctx context.Context) ([]loadResult, error) {
	for _, w := range r.ws {
		if _, err := io.WriteString(w.in, "go\n"); err != nil {
			return nil, err
		}
	}
	results := make([]loadResult, len(r.ws))
	for i, w := range r.ws {
		line, err := w.out.ReadString('\n')
		if err != nil {
			return nil, fmt.Errorf("worker %d: %w", i, err)
		}
		if err := json.Unmarshal([]byte(line), &results[i]); err != nil {
			return nil, fmt.Errorf("worker %d: %w", i, err)
		}
	}
	return results, nil
}

// close ends the workers: each exits once its standard input is closed.
func (r *remoteRunner) close() {
	for _, w := range r.ws {
		_ = w.in.Close()
		_ = w.cmd.Wait()
	}
}

// workerMain is a load worker's life: it prepares spec (JSON), says
// "ready", then runs a round for each "go" it reads on stdin, printing
// each round's result as a line of JSON, until stdin closes.
func workerMain(ctx context.Context, specJSON string, stdin io.Reader, stdout, stderr io.Writer) int {
	var spec loadSpec
	if err := json.Unmarshal([]byte(specJSON), &spec); err != nil {
		fmt.Fprintln(stderr, "slotbench worker:", err)
		return 2
	}
	l, err := prepareLoad(ctx, spec)
	if err != nil {
		fmt.Fprintln(stderr, "slotbench worker:", err)
		return 1
	}
	defer l.close()
	fmt.Fprintln(stdout, "ready")
	in := bufio.NewReader(stdin)
	enc := json.NewEncoder(stdout)
	for {
		line, err := in.ReadString('\n')
		if err == io.EOF && line == "" {
			return 0
		}
		if err != nil || strings.TrimSpace(line) != "go" {
			fmt.Fprintf(stderr, "slotbench worker: want \"go\", got %q: %v\n", line, err)
			return 1
		}
		if err := enc.Encode(l.run(ctx)); err != nil {
			fmt.Fprintln(stderr, "slotbench worker:", err)
			return 1
		}
	}
}

// loadSpec is one process's share of a scaling point.
type loadSpec struct {
	Addrs      []string      `json:"addrs"`
	Cluster    bool          `json:"cluster"`
	Strategy   string        `json:"strategy"`
	Keys       int           `json:"keys"`
	Goroutines int           `json:"goroutines"`
	Prefix     string        `json:"prefix"`
	Duration   time.Duration `json:"duration"`
}

// loadResult is what one process measured.
type loadResult struct {
	Granted    int64            `json:"granted"`     // let through at once
	NotAtOnce  int64            `json:"not_at_once"` // not let through at once (see load.op)
	Errors     int64            `json:"errors"`
	FirstError string           `json:"first_error,omitempty"`
	Calls      int64            `json:"calls"`
	Elapsed    time.Duration    `json:"elapsed"`
	ClientCPU  time.Duration    `json:"client_cpu"` // the process's user + system CPU over the round
	Hist       latencyHist      `json:"hist"`
	PerNode    map[string]int64 `json:"per_node,omitempty"`  // granted, by the master holding the key
	NodeKeys   map[string]int64 `json:"node_keys,omitempty"` // the spec's keys, by the master holding each
}

// load is a prepared process share: its client, its strategy and its keys.
type load struct {
	spec   loadSpec
	calls  *callcount.Counter
	names  []string
	nodeOf []string // cluster: the master holding each key's state
	// op makes one request on key. granted is true when the request was
	// let through at once, what redis_rate's Allow grants: a reservation
	// whose slot was now when Redis booked it (Booking().Wait 0), a pool
	// job whose booking was such. A reservation booked for a later slot
	// (the limiter has no max wait, so it books however far ahead), a pool
	// job that waited for its slot and a request redis_rate refused are
	// not granted, and not errors: run counts them apart (NotAtOnce). A
	// reservation booked ahead is left booked: cancelling it would cost a
	// call that redis_rate's refusal does not.
	op     func(ctx context.Context, key string) (granted bool, took time.Duration, err error)
	closes []func()
}

// openLimit is never reached: every request is granted at once, so the
// points measure the cost of a decision, not the limit. A point that
// reaches it all the same (a faster machine) counts the requests it did
// not let through at once (ScalePoint.NotAtOnce), and the report says so.
var openLimit = throttle.PerSecond(1_000_000, 1_000_000)

func prepareLoad(ctx context.Context, spec loadSpec) (_ *load, err error) {
	if spec.Keys <= 0 || spec.Goroutines <= 0 || spec.Duration <= 0 || len(spec.Addrs) == 0 {
		return nil, fmt.Errorf("bad load spec %+v", spec)
	}
	l := &load{spec: spec, calls: new(callcount.Counter)}
	defer func() {
		if err != nil {
			l.close()
		}
	}()
	var rdb redis.UniversalClient
	if spec.Cluster {
		rdb = redis.NewClusterClient(&redis.ClusterOptions{Addrs: slices.Clone(spec.Addrs), ContextTimeoutEnabled: true})
	} else {
		rdb = redis.NewClient(&redis.Options{Addr: spec.Addrs[0], ContextTimeoutEnabled: true})
	}
	l.closes = append(l.closes, func() { _ = rdb.Close() })
	rdb.AddHook(l.calls)
	l.names = make([]string, spec.Keys)
	for i := range l.names {
		l.names[i] = fmt.Sprintf("k%07d", i)
	}
	// The same key names as slotbench's other sections: the engine's
	// prefix is redis_rate's.
	const name = "scale"
	stateKey := func(k string) string { return "rate:" + spec.Prefix + name + ":{" + k + "}" }
	switch spec.Strategy {
	case stratCoalesced, stratUncoalesced, stratPool:
		eng, err := throttle.New(rdb, throttle.WithPrefix("rate:"+spec.Prefix), throttle.WithTimeout(5*time.Second))
		if err != nil {
			return nil, err
		}
		if err := eng.Load(ctx); err != nil {
			return nil, err
		}
		lim, err := reserve.New(eng, name, openLimit, reserve.WithCoalescing(spec.Strategy != stratUncoalesced))
		if err != nil {
			return nil, err
		}
		if spec.Strategy != stratPool {
			l.op = func(ctx context.Context, key string) (bool, time.Duration, error) {
				t := time.Now()
				r, err := lim.Reserve(ctx, key)
				took := time.Since(t)
				return err == nil && r.OK() && r.Booking().Wait == 0, took, err
			}
			break
		}
		p, err := pool.New(lim, pool.WithWorkers(spec.Goroutines))
		if err != nil {
			return nil, err
		}
		l.closes = append(l.closes, func() { _ = p.Close(context.Background()) })
		nop := func(context.Context) error { return nil }
		l.op = func(ctx context.Context, key string) (bool, time.Duration, error) {
			t := time.Now()
			j, err := p.Submit(ctx, key, nop)
			if err != nil {
				return false, 0, err
			}
			if err := j.Wait(ctx); err != nil {
				return false, 0, err
			}
			r := j.Reservation()
			return r != nil && r.Booking().Wait == 0, j.Started().Sub(t), nil
		}
	case stratRedisRate:
		rr := redis_rate.NewLimiter(rdb)
		open := redis_rate.Limit{Rate: openLimit.Rate, Burst: openLimit.Burst, Period: openLimit.Period}
		stateKey = func(k string) string { return "rate:" + spec.Prefix + k }
		l.op = func(ctx context.Context, key string) (bool, time.Duration, error) {
			t := time.Now()
			r, err := rr.Allow(ctx, spec.Prefix+key, open)
			took := time.Since(t)
			return err == nil && r.Allowed > 0, took, err
		}
	default:
		return nil, fmt.Errorf("unknown strategy %q", spec.Strategy)
	}
	if cc, ok := rdb.(*redis.ClusterClient); ok {
		l.nodeOf = make([]string, spec.Keys)
		for i, k := range l.names {
			m, err := cc.MasterForKey(ctx, stateKey(k))
			if err != nil {
				return nil, err
			}
			l.nodeOf[i] = m.Options().Addr
		}
	}
	// Warm up: connections open, scripts cached, every key once.
	if err := parallel(ctx, min(spec.Goroutines, 64), max(spec.Keys, 4*spec.Goroutines), func(ctx context.Context, i int) error {
		_, _, err := l.op(ctx, l.names[i%spec.Keys])
		return err
	}); err != nil {
		return nil, fmt.Errorf("warm-up: %w", err)
	}
	return l, nil
}

func (l *load) close() {
	for i := len(l.closes) - 1; i >= 0; i-- {
		l.closes[i]()
	}
}

// run has the spec's goroutines make requests, each on the next key in
// turn (from a point of its own), until the duration is over.
func (l *load) run(ctx context.Context) loadResult {
	type tally struct {
		granted, later int64
		errors         int64
		first          error
		hist           latencyHist
		perNode        map[string]int64
	}
	tallies := make([]tally, l.spec.Goroutines)
	calls0 := l.calls.Load()
	cpu0 := processCPU()
	start := time.Now()
	end := start.Add(l.spec.Duration)
	var wg sync.WaitGroup
	for g := range tallies {
		wg.Add(1)
		go func() {
			defer wg.Done()
			t := &tallies[g]
			if l.nodeOf != nil {
				t.perNode = make(map[string]int64)
			}
			i := g * 7919
			for ctx.Err() == nil && time.Now().Before(end) {
				i++
				k := i % l.spec.Keys
				granted, took, err := l.op(ctx, l.names[k])
				switch {
				case err != nil:
					t.errors++
					if t.first == nil {
						t.first = err
					}
				case granted:
					t.granted++
					t.hist.add(took)
					if t.perNode != nil {
						t.perNode[l.nodeOf[k]]++
					}
				default:
					t.later++
				}
			}
		}()
	}
	wg.Wait()
	r := loadResult{Elapsed: time.Since(start), Calls: l.calls.Load() - calls0, ClientCPU: processCPU() - cpu0}
	if l.nodeOf != nil {
		r.NodeKeys = make(map[string]int64)
		for _, n := range l.nodeOf {
			r.NodeKeys[n]++
		}
	}
	for _, t := range tallies {
		r.Granted += t.granted
		r.NotAtOnce += t.later
		r.Errors += t.errors
		if t.first != nil && r.FirstError == "" {
			r.FirstError = t.first.Error()
		}
		r.Hist.merge(t.hist)
		for n, c := range t.perNode {
			if r.PerNode == nil {
				r.PerNode = make(map[string]int64)
			}
			r.PerNode[n] += c
		}
	}
	return r
}

// latencyHist counts latencies in buckets 5% wide from 1µs up.
type latencyHist []int64

const (
	histBuckets = 400
	histGrowth  = 1.05
)

func (h *latencyHist) add(d time.Duration) {
	if *h == nil {
		*h = make(latencyHist, histBuckets)
	}
	i := 0
	if us := float64(d) / float64(time.Microsecond); us > 1 {
		i = min(histBuckets-1, int(math.Log(us)/math.Log(histGrowth))+1)
	}
	(*h)[i]++
}

func (h *latencyHist) merge(o latencyHist) {
	if len(o) == 0 {
		return
	}
	if *h == nil {
		*h = make(latencyHist, histBuckets)
	}
	for i, n := range o {
		(*h)[i] += n
	}
}

// quantile returns the upper edge of the bucket holding quantile q, by
// the nearest rank (nearestRank), as percentiles takes it.
func (h latencyHist) quantile(q float64) time.Duration {
	var total int64
	for _, n := range h {
		total += n
	}
	if total == 0 {
		return 0
	}
	rank := nearestRank(total, q)
	var seen int64
	for i, n := range h {
		seen += n
		if seen >= rank {
			return time.Duration(math.Pow(histGrowth, float64(i)) * float64(time.Microsecond))
		}
	}
	return 0
}

// serverStats is a redis-server's CPU and command time so far.
type serverStats struct {
	cpuUsec  float64 // used_cpu_sys + used_cpu_user
	cmdCalls int64   // calls of the commands clients send to be timed (clientCommands)
	cmdUsec  int64   // their time by INFO commandstats
}

// clientCommands are the commands whose INFO commandstats time is command
// µs: those the strategies' clients send, the scripts. slotbook's engine
// and redis_rate send EVALSHA, and EVAL after a NOSCRIPT; the read-only
// forms and FCALL are here should a strategy come to send them.
// commandstats also lists each command a script runs (its redis.call's)
// under its own name, and its time is already inside the script's: adding
// those lines counted the scripts' work twice.
var clientCommands = map[string]bool{
	"evalsha": true, "eval": true, "evalsha_ro": true, "eval_ro": true, "fcall": true, "fcall_ro": true,
}

func (s serverStats) sub(o serverStats) serverStats {
	return serverStats{s.cpuUsec - o.cpuUsec, s.cmdCalls - o.cmdCalls, s.cmdUsec - o.cmdUsec}
}

func (s serverStats) add(o serverStats) serverStats {
	return serverStats{s.cpuUsec + o.cpuUsec, s.cmdCalls + o.cmdCalls, s.cmdUsec + o.cmdUsec}
}

func snapshot(ctx context.Context, c *redis.Client) (serverStats, error) {
	info, err := c.Info(ctx, "cpu", "commandstats").Result()
	if err != nil {
		return serverStats{}, err
	}
	var s serverStats
	for _, f := range []string{"used_cpu_sys", "used_cpu_user"} {
		v, err := strconv.ParseFloat(infoField(info, f), 64)
		if err != nil {
			return serverStats{}, fmt.Errorf("INFO cpu %s: %w", f, err)
		}
		s.cpuUsec += v * 1e6
	}
	sc := bufio.NewScanner(strings.NewReader(info))
	for sc.Scan() {
		name, rest, ok := strings.Cut(strings.TrimPrefix(sc.Text(), "cmdstat_"), ":")
		if !ok || !strings.HasPrefix(sc.Text(), "cmdstat_") || !clientCommands[name] {
			continue
		}
		for _, kv := range strings.Split(rest, ",") {
			k, v, _ := strings.Cut(kv, "=")
			n, _ := strconv.ParseInt(v, 10, 64)
			switch k {
			case "calls":
				s.cmdCalls += n
			case "usec":
				s.cmdUsec += n
			}
		}
	}
	return s, nil
}

// processCPU is this process's user and system CPU time so far.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
