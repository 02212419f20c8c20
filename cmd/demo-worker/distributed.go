package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"
	"golang.org/x/sync/errgroup"

	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/contention"
	"github.com/slotbook/slotbook/metrics"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// worker is one process of a distributed run: its clients reserve on the
// shared key from the agreed start, and it prints its result as JSON, with
// each start measured from that agreed time.
func worker(ctx context.Context, o options, stdout io.Writer) error {
	opts, err := redis.ParseURL(o.redisURL)
	if err != nil {
		return fmt.Errorf("-redis: %w", err)
	}
	opts.ContextTimeoutEnabled = true
	rdb := redis.NewClient(opts)
	defer rdb.Close()
	calls := callcount.Attach(rdb)
	eng, err := throttle.New(rdb, throttle.WithPrefix("slotbook-demo:"), throttle.WithTimeout(time.Second))
	if err != nil {
		return err
	}
	if err := eng.Load(ctx); err != nil {
		return err
	}
	limit := throttle.Every(o.period, o.rate, o.burst)
	lim, err := reserve.New(eng, "distributed", limit, reserve.WithMaxWait(o.maxWait), reserve.WithCoalescing(false))
	if err != nil {
		return err
	}
	start := o.start
	if start.IsZero() {
		start = time.Now()
	}
	res, err := contention.Reserve(ctx, lim, o.key, contention.Config{
		Clients: o.clients, Limit: limit, Duration: o.duration, MaxWait: o.maxWait,
		Calls: calls.Load, Start: start,
	})
	if err != nil {
		return err
	}
	return json.NewEncoder(stdout).Encode(res)
}

// coordinate starts o.processes worker processes of this program against
// one Redis (an embedded one, served on loopback, unless -redis is given),
// waits for them, and prints each one's row and the combined figures.
func coordinate(ctx context.Context, o options, stdout, stderr io.Writer) error {
	ropts, where, closeRedis, err := connect(o.redisURL)
	if err != nil {
		return err
	}
	defer closeRedis()
	url := o.redisURL
	if url == "" {
		url = "redis://" + ropts.Addr
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	key := o.key
	if key == "" {
		key = "run-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	}
	limit := throttle.Every(o.period, o.rate, o.burst)
	// Give every process time to start and connect before the agreed start.
	start := time.Now().Add(time.Second)
	fmt.Fprintf(stdout, "slotbook demo, distributed: %d clients in %d processes share %v for %v (%s)\n\n",
		o.clients, o.processes, limit, o.duration, where)

	results := make([]contention.Result, o.processes)
	g, gctx := errgroup.WithContext(ctx)
	for p := 0; p < o.processes; p++ {
		// The clients are shared out between the processes.
		clients := o.clients / o.processes
		if p < o.clients%o.processes {
			clients++
		}
		g.Go(func() error {
			var out, errb bytes.Buffer
			cmd := exec.CommandContext(gctx, self, "-role", "worker", "-redis", url, "-key", key,
				"-clients", strconv.Itoa(max(1, clients)), "-rate", strconv.Itoa(o.rate), "-burst", strconv.Itoa(o.burst),
				"-period", o.period.String(), "-duration", o.duration.String(), "-max-wait", o.maxWait.String(),
				"-start-unix-ns", strconv.FormatInt(start.UnixNano(), 10))
			cmd.Stdout, cmd.Stderr = &out, &errb
			if err := cmd.Run(); err != nil {
				return fmt.Errorf("worker process %d: %w: %s", p, err, errb.String())
			}
			return json.Unmarshal(out.Bytes(), &results[p])
		})
	}
	if err := g.Wait(); err != nil {
		return err
	}
	combined := combine(results, limit)
	tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "process\tthrough\tredis calls\trefusals\tcalls/request\tmean spacing\tmin spacing\t")
	for p, r := range append(results, combined.Result) {
		name := strconv.Itoa(p + 1)
		if p == len(results) {
			name = "all"
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%.2f\t%s\t%s\t\n", name, r.Through, r.Calls, r.Denials,
			r.CallsPerRequest, fmtDur(r.MeanSpacing), fmtDur(r.MinSpacing))
	}
	tw.Flush()
	fmt.Fprintf(stdout, "\ncombined rate %.3f/s against a limit of %.3f/s: %+.2f%%\n",
		combined.Rate, combined.Limit, 100*(combined.Rate-combined.Limit)/combined.Limit)
	return nil
}

// Combined is a distributed run's figures over every process.
type Combined struct {
	contention.Result
	Rate  float64 // starts per second after the first burst
	Limit float64 // the configured rate, per second
}

func combine(results []contention.Result, limit throttle.Limit) Combined {
	var c Combined
	c.Mode = "reserve"
	for _, r := range results {
		c.Through += r.Through
		c.Calls += r.Calls
		c.Denials += r.Denials
		c.Starts = append(c.Starts, r.Starts...)
	}
	slices.Sort(c.Starts)
	if c.Through > 0 {
		c.CallsPerRequest = float64(c.Calls) / float64(c.Through)
	}
	c.MeanSpacing, c.MinSpacing = contention.Spacing(c.Starts, limit.Burst)
	if c.MeanSpacing > 0 {
		c.Rate = float64(time.Second) / float64(c.MeanSpacing)
	}
	c.Limit = float64(limit.Rate) / limit.Period.Seconds()
	return c
}

// serveMetrics serves the collector's metrics on addr until stop is called.
func serveMetrics(addr string, m *metrics.Collector, stderr io.Writer) (stop func(), err error) {
	_, stop, err = listenMetrics(addr, m, stderr)
	return stop, err
}

// listenMetrics is serveMetrics, also returning the address it listens on.
func listenMetrics(addr string, m *metrics.Collector, stderr io.Writer) (net.Addr, func(), error) {
	reg := prometheus.NewRegistry()
	if err := reg.Register(m); err != nil {
		return nil, nil, err
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, nil, fmt.Errorf("-metrics: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			fmt.Fprintln(stderr, "demo-worker: metrics:", err)
		}
	}()
	fmt.Fprintf(stderr, "serving metrics on http://%s/metrics\n", ln.Addr())
	return ln.Addr(), func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
		<-done
	}, nil
}
