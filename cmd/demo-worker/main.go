// Command demo-worker runs the seed experiment: clients share one rate
// limit through Redis in three modes side by side (retrying after each
// denial, reserving their slots, and a worker pool booking in batches) and
// prints what each mode cost.
//
//	go run ./cmd/demo-worker                              # embedded Redis, 20 clients, 10/s burst 5, 3 s
//	go run ./cmd/demo-worker -redis redis://127.0.0.1:6379/0
//	go run ./cmd/demo-worker -plot timeline.png           # draw each client's starts
//	go run ./cmd/demo-worker -processes 3                 # three OS processes share the quota
//	go run ./cmd/demo-worker -metrics 127.0.0.1:9090      # serve /metrics while running
//
// With -metrics, each mode's limiter is labelled by its mode (demo-retry,
// demo-reserve, demo-pool). With -processes, the reserve mode runs in that
// many worker processes, which are stopped with the coordinator (SIGINT or
// SIGTERM); they get the Redis URL, password included, through their
// environment, never their command line. -processes takes -json but not
// -plot, -metrics or other -modes.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"golang.org/x/sync/errgroup"

	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/contention"
	"github.com/slotbook/slotbook/metrics"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

// isTerminal reports whether f is a terminal, where progress lines belong.
func isTerminal(f *os.File) bool {
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}

type options struct {
	redisURL string
	clients  int
	rate     int
	burst    int
	period   time.Duration
	duration time.Duration
	maxWait  time.Duration
	modes    []string
	json     bool
	quiet    bool
	plot     string
	metrics  string

	// The lease experiment.
	leases int           // concurrency limit; 0: the rate modes instead
	work   time.Duration // how long each job holds its lease

	// Distributed mode.
	processes int       // coordinator: worker processes to start
	role      string    // "worker" for one of them
	key       string    // the shared key
	start     time.Time // when workers begin
}

var allModes = contention.Modes

// run is main without the process: it returns the exit code (2 for bad
// flags).
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	o, err := parseFlags(args, stderr)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		fmt.Fprintln(stderr, "demo-worker:", err)
		return 2
	}
	switch {
	case o.role == "worker":
		err = worker(ctx, o, os.Stdin, stdout)
	case o.processes > 0:
		err = coordinate(ctx, o, stdout, stderr)
	case o.leases > 0:
		err = leaseDemo(ctx, o, stdout)
	default:
		err = demo(ctx, o, stdout, stderr)
	}
	if err != nil {
		fmt.Fprintln(stderr, "demo-worker:", err)
		return 1
	}
	return 0
}

func parseFlags(args []string, stderr io.Writer) (options, error) {
	var o options
	fs := flag.NewFlagSet("demo-worker", flag.ContinueOnError)
	fs.SetOutput(io.Discard) // errors are reported in one line by run
	fs.StringVar(&o.redisURL, "redis", "", "Redis URL (redis:// or rediss://, with auth if needed); empty: an embedded Redis")
	fs.IntVar(&o.clients, "clients", 20, "competing clients")
	fs.IntVar(&o.rate, "rate", 10, "requests per period")
	fs.IntVar(&o.burst, "burst", 5, "burst: extra requests allowed back to back after idling")
	fs.DurationVar(&o.period, "period", time.Second, "the rate's period")
	fs.DurationVar(&o.duration, "duration", 3*time.Second, "how long clients start new requests")
	fs.DurationVar(&o.maxWait, "max-wait", 2*time.Second, "longest wait a reservation accepts")
	modes := fs.String("modes", strings.Join(allModes, ","), "modes to run, comma-separated: "+strings.Join(allModes, ", "))
	fs.BoolVar(&o.json, "json", false, "print one JSON object per mode instead of the table")
	fs.BoolVar(&o.quiet, "quiet", false, "no progress lines (the default when stderr is not a terminal)")
	fs.StringVar(&o.plot, "plot", "", "write a timeline of each mode's starts to this .png file")
	fs.StringVar(&o.metrics, "metrics", "", "serve Prometheus /metrics on this address while running")
	fs.IntVar(&o.processes, "processes", 0, "distributed mode: share the -clients between this many worker processes on one key, and print their combined table")
	fs.StringVar(&o.role, "role", "", `"worker": run as one process of a distributed run (needs -key, and -redis or `+redisURLEnv+` in the environment)`)
	fs.StringVar(&o.key, "key", "", "distributed mode: the key the processes share")
	fs.IntVar(&o.leases, "leases", 0, "run the lease experiment instead: at most this many jobs at once across processes (package lease), each at a slot of the rate")
	fs.DurationVar(&o.work, "work", 300*time.Millisecond, "the lease experiment: how long each job holds its lease")
	startNS := fs.Int64("start-unix-ns", 0, "distributed mode: when the workers begin")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fs.SetOutput(stderr)
			fs.Usage()
		}
		return o, err
	}
	if *startNS > 0 {
		o.start = time.Unix(0, *startNS)
	}
	if f, ok := stderr.(*os.File); !ok || !isTerminal(f) {
		o.quiet = true
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if o.role == "worker" && o.redisURL == "" {
		o.redisURL = os.Getenv(redisURLEnv) // the coordinator's way: not visible in ps
	}
	switch {
	case o.clients <= 0:
		return o, fmt.Errorf("-clients %d: must be positive", o.clients)
	case o.duration <= 0:
		return o, fmt.Errorf("-duration %v: must be positive", o.duration)
	case o.maxWait < 0:
		return o, fmt.Errorf("-max-wait %v: must not be negative", o.maxWait)
	case o.processes < 0 || o.processes > 64 || (o.processes > o.clients):
		return o, fmt.Errorf("-processes %d: want 1 to 64, and no more than -clients", o.processes)
	case o.role != "" && o.role != "worker":
		return o, fmt.Errorf("-role %q: the only role is \"worker\"", o.role)
	case o.role == "worker" && (o.redisURL == "" || o.key == ""):
		return o, errors.New("-role worker needs -redis and -key")
	case o.plot != "" && !strings.HasSuffix(o.plot, ".png"):
		return o, fmt.Errorf("-plot %q: want a .png file", o.plot)
	case o.processes > 0 && set["modes"] && strings.TrimSpace(*modes) != "reserve":
		return o, fmt.Errorf("-processes runs the reserve mode only, not -modes %q", *modes)
	case o.leases < 0 || o.work <= 0:
		return o, fmt.Errorf("-leases %d, -work %v: want -leases >= 0 and a positive -work", o.leases, o.work)
	case o.leases > 0 && (o.processes > 0 || o.role != "" || set["modes"] || o.plot != "" || o.metrics != ""):
		return o, errors.New("-leases runs an experiment of its own: it does not take -processes, -modes, -plot or -metrics")
	case o.processes > 0 && (o.plot != "" || o.metrics != ""):
		return o, errors.New("-processes does not take -plot or -metrics (its workers are other processes)")
	}
	if o.redisURL != "" {
		if _, err := redis.ParseURL(o.redisURL); err != nil {
			return o, fmt.Errorf("-redis: %w", err)
		}
	}
	if err := throttle.Every(o.period, o.rate, o.burst).Validate(); err != nil {
		return o, fmt.Errorf("-rate/-burst/-period: %w", err)
	}
	for _, m := range strings.Split(*modes, ",") {
		m = strings.TrimSpace(m)
		if !contains(allModes, m) {
			return o, fmt.Errorf("-modes: unknown mode %q (want %s)", m, strings.Join(allModes, ", "))
		}
		o.modes = append(o.modes, m)
	}
	return o, nil
}

func demo(ctx context.Context, o options, stdout, stderr io.Writer) error {
	ropts, where, closeRedis, err := connect(o.redisURL)
	if err != nil {
		return err
	}
	defer closeRedis()
	if err := reach(ctx, ropts, where); err != nil {
		return err
	}
	limit := throttle.Every(o.period, o.rate, o.burst)
	// A prefix of its own, so runs against a shared Redis never meet.
	prefix := "slotbook-demo:" + strconv.FormatInt(time.Now().UnixNano(), 36) + ":"

	var observer throttle.Observer
	if o.metrics != "" {
		m, err := metrics.New()
		if err != nil {
			return err
		}
		stop, err := serveMetrics(o.metrics, m, stderr)
		if err != nil {
			return err
		}
		defer stop()
		observer = m
	}

	// The modes run side by side, each on a key and a Redis client of its
	// own, so each counts only its own calls.
	runs := make([]*modeRun, len(o.modes))
	for i, mode := range o.modes {
		r, err := newModeRun(ctx, mode, ropts, prefix, limit, o, observer)
		if err != nil {
			return fmt.Errorf("%s: %w", where, err)
		}
		defer r.rdb.Close()
		runs[i] = r
	}
	if !o.json {
		fmt.Fprintf(stdout, "slotbook demo: %d clients share %v for %v (%s)\n\n", o.clients, limit, o.duration, where)
	}

	g, gctx := errgroup.WithContext(ctx)
	for _, r := range runs {
		g.Go(func() error { return r.run(gctx) })
	}
	stopProgress := func() {}
	if !o.quiet {
		stopProgress = progress(stderr, runs)
	}
	err = g.Wait()
	stopProgress()
	if err != nil {
		return err
	}

	results := make([]contention.Result, len(runs))
	for i, r := range runs {
		results[i] = r.res
	}
	if o.plot != "" {
		if err := writePlot(o.plot, results); err != nil {
			return err
		}
		fmt.Fprintf(stderr, "wrote %s\n", o.plot)
	}
	if o.json {
		enc := json.NewEncoder(stdout)
		for _, res := range results {
			if err := enc.Encode(res); err != nil {
				return err
			}
		}
		return nil
	}
	printTable(stdout, results)
	return nil
}

// modeRun is one mode's experiment with its own client.
type modeRun struct {
	mode    string
	rdb     *redis.Client
	lim     *reserve.Limiter
	cfg     contention.Config
	through atomic.Int64
	res     contention.Result
}

func newModeRun(ctx context.Context, mode string, ropts *redis.Options, prefix string, limit throttle.Limit, o options, observer throttle.Observer) (*modeRun, error) {
	rdb := redis.NewClient(ropts)
	calls := callcount.Attach(rdb)
	opts := []throttle.Option{throttle.WithPrefix(prefix), throttle.WithTimeout(time.Second)}
	if observer != nil {
		opts = append(opts, throttle.WithObserver(observer))
	}
	eng, err := throttle.New(rdb, opts...)
	if err == nil {
		err = eng.Load(ctx)
	}
	var lim *reserve.Limiter
	if err == nil {
		// Each client stands for a process of its own, so the limiter does
		// not coalesce their calls (coalescing shares calls within one
		// process; the pool mode shows what a process can save). Named by
		// mode, so that each mode's metrics have a label of their own.
		lim, err = reserve.New(eng, limiterName(mode), limit, reserve.WithMaxWait(o.maxWait), reserve.WithCoalescing(false))
	}
	if err != nil {
		rdb.Close()
		return nil, err
	}
	r := &modeRun{mode: mode, rdb: rdb, lim: lim}
	r.cfg = contention.Config{
		Clients: o.clients, Limit: limit, Duration: o.duration, MaxWait: o.maxWait,
		Calls:    calls.Load,
		Progress: func(_ time.Duration, through int) { r.through.Store(int64(through)) },
	}
	return r, nil
}

func (r *modeRun) run(ctx context.Context) error {
	var err error
	r.res, err = contention.Run(ctx, r.mode, r.lim, r.mode, r.cfg)
	r.through.Store(int64(r.res.Through))
	return err
}

// progress prints a line of the requests through per mode until stopped.
func progress(w io.Writer, runs []*modeRun) (stop func()) {
	done := make(chan struct{})
	finished := make(chan struct{})
	t0 := time.Now()
	go func() {
		defer close(finished)
		tick := time.NewTicker(250 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-done:
				fmt.Fprint(w, "\r\033[K")
				return
			case <-tick.C:
				line := fmt.Sprintf("%5.1fs", time.Since(t0).Seconds())
				for _, r := range runs {
					line += fmt.Sprintf("   %s %d through", r.mode, r.through.Load())
				}
				fmt.Fprint(w, "\r"+line)
			}
		}
	}()
	return func() { close(done); <-finished }
}

// limiterName is the limiter (and metrics label) of a mode's run.
func limiterName(mode string) string { return "demo-" + mode }

// redisURLEnv is the environment variable through which the coordinator
// hands worker processes the Redis URL (which may hold a password).
const redisURLEnv = "SLOTBOOK_DEMO_REDIS_URL"

// reach checks that Redis at opts answers, dialling once, so that a Redis
// that is down is reported as such ("connection refused") rather than as a
// later call's timeout.
func reach(ctx context.Context, opts *redis.Options, where string) error {
	o := *opts
	o.MaxRetries, o.DialerRetries = -1, 1
	c := redis.NewClient(&o)
	defer c.Close()
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := c.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("cannot reach %s: %w", where, err)
	}
	return nil
}

// connect returns client options for url, or for an embedded Redis when
// url is empty, with a description and a function that stops what it
// started.
func connect(url string) (*redis.Options, string, func(), error) {
	if url == "" {
		mr, err := miniredis.Run()
		if err != nil {
			return nil, "", nil, fmt.Errorf("embedded Redis: %w", err)
		}
		return &redis.Options{Addr: mr.Addr(), ContextTimeoutEnabled: true}, "embedded Redis", mr.Close, nil
	}
	opts, err := redis.ParseURL(url)
	if err != nil {
		return nil, "", nil, fmt.Errorf("-redis: %w", err)
	}
	opts.ContextTimeoutEnabled = true
	return opts, "Redis at " + opts.Addr, func() {}, nil
}

func printTable(w io.Writer, results []contention.Result) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "mode\tthrough\tredis calls\tdenials\tcalls/request\tmean spacing\tmin spacing\tmax booked wait\t")
	for _, r := range results {
		maxWait := "-"
		if r.Mode != "retry" {
			maxWait = fmtDur(r.MaxBookedWait)
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%s\t%s\t%s\t%s\t\n", r.Mode, r.Through, r.Calls, r.Denials,
			perRequest(r), spacing(r.MeanSpacing, r), spacing(r.MinSpacing, r), maxWait)
	}
	tw.Flush()
	fmt.Fprintln(w, "\nPublished figures, 20 clients at 10/s burst 5 for 3 s: retry 36 through for 648 calls; reservation 55 for at most 55 (one call each, fewer where clients that start together merge).")
}

// perRequest is r's Redis calls per request through, or "-" if none went
// through (the calls were all spent on refusals).
func perRequest(r contention.Result) string {
	if r.Through == 0 {
		return "-"
	}
	return fmt.Sprintf("%.2f", float64(r.Calls)/float64(r.Through))
}

// spacing formats a spacing of r's starts, or "-" where r has too few
// starts after the burst to space (contention.Spacing reports 0 then).
func spacing(d time.Duration, r contention.Result) string {
	if r.MeanSpacing == 0 {
		return "-"
	}
	return fmtDur(d)
}

func fmtDur(d time.Duration) string {
	if d >= time.Second {
		return fmt.Sprintf("%.2fs", d.Seconds())
	}
	return fmt.Sprintf("%.1fms", float64(d)/float64(time.Millisecond))
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}
