// Command demo-worker runs the seed experiment: clients share one rate
// limit through Redis, first retrying after each denial, then reserving
// their slots, and prints what each mode cost.
//
//	go run ./cmd/demo-worker                          # embedded Redis, 20 clients, 10/s burst 5, 3 s
//	go run ./cmd/demo-worker -redis redis://127.0.0.1:6379/0
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
	"text/tabwriter"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/contention"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
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
}

var allModes = []string{"retry", "reserve"}

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
	if err := demo(ctx, o, stdout, stderr); err != nil {
		fmt.Fprintln(stderr, "demo-worker:", err)
		return 1
	}
	return 0
}

func parseFlags(args []string, stderr io.Writer) (options, error) {
	var o options
	fs := flag.NewFlagSet("demo-worker", flag.ContinueOnError)
	fs.SetOutput(stderr)
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
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if f, ok := stderr.(*os.File); !ok || !isTerminal(f) {
		o.quiet = true
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	switch {
	case o.clients <= 0:
		return o, fmt.Errorf("-clients %d: must be positive", o.clients)
	case o.duration <= 0:
		return o, fmt.Errorf("-duration %v: must be positive", o.duration)
	case o.maxWait < 0:
		return o, fmt.Errorf("-max-wait %v: must not be negative", o.maxWait)
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
	rdb := redis.NewClient(ropts)
	defer rdb.Close()
	calls := callcount.Attach(rdb)

	// A prefix of its own, so runs against a shared Redis never meet.
	prefix := "slotbook-demo:" + strconv.FormatInt(time.Now().UnixNano(), 36) + ":"
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(time.Second))
	if err != nil {
		return err
	}
	if err := eng.Load(ctx); err != nil {
		return fmt.Errorf("%s: %w", where, err)
	}
	limit := throttle.Every(o.period, o.rate, o.burst)
	lim, err := reserve.New(eng, "demo", limit, reserve.WithMaxWait(o.maxWait))
	if err != nil {
		return err
	}
	if !o.json {
		fmt.Fprintf(stdout, "slotbook demo: %d clients share %v for %v (%s)\n\n", o.clients, limit, o.duration, where)
	}
	var results []contention.Result
	for _, mode := range o.modes {
		cfg := contention.Config{
			Clients: o.clients, Limit: limit, Duration: o.duration, MaxWait: o.maxWait,
			Calls: calls.Load,
		}
		if !o.quiet {
			cfg.Progress = func(elapsed time.Duration, through int) {
				fmt.Fprintf(stderr, "\r%-8s %5.1fs  %4d through", mode, elapsed.Seconds(), through)
			}
		}
		var res contention.Result
		switch mode {
		case "retry":
			res, err = contention.Retry(ctx, lim, mode, cfg)
		case "reserve":
			res, err = contention.Reserve(ctx, lim, mode, cfg)
		}
		if !o.quiet {
			fmt.Fprint(stderr, "\r\033[K")
		}
		if err != nil {
			return err
		}
		results = append(results, res)
		if o.json {
			if err := json.NewEncoder(stdout).Encode(res); err != nil {
				return err
			}
		}
	}
	if !o.json {
		printTable(stdout, results)
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
		return &redis.Options{Addr: mr.Addr()}, "embedded Redis", mr.Close, nil
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
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%.2f\t%s\t%s\t%s\t\n", r.Mode, r.Through, r.Calls, r.Denials,
			r.CallsPerRequest, fmtDur(r.MeanSpacing), fmtDur(r.MinSpacing), maxWait)
	}
	tw.Flush()
	fmt.Fprintln(w, "\nPublished figures, 20 clients at 10/s burst 5 for 3 s: retry 36 through for 648 calls; reservation 55 for 55.")
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
