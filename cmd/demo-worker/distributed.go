package main

import (
	"bufio"
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
	"strings"
	"syscall"
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

// worker is one process of a distributed run: once connected it prints
// "ready" and reads the agreed start (Unix nanoseconds) from stdin, unless
// -start-unix-ns gave it; its clients reserve on the shared key from then
// on, and it prints its result as JSON, with each start measured from the
// agreed time.
func worker(ctx context.Context, o options, stdin io.Reader, stdout io.Writer) error {
	opts, err := redis.ParseURL(o.redisURL)
	if err != nil {
		return fmt.Errorf("-redis: %w", err)
	}
	opts.ContextTimeoutEnabled = true
	if err := reach(ctx, opts, "Redis at "+opts.Addr); err != nil {
		return err
	}
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
		if start, err = awaitStart(ctx, stdin, stdout); err != nil {
			return err
		}
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

// awaitStart tells the coordinator this worker is ready and reads the
// agreed start from it.
func awaitStart(ctx context.Context, stdin io.Reader, stdout io.Writer) (time.Time, error) {
	if _, err := fmt.Fprintln(stdout, readyLine); err != nil {
		return time.Time{}, err
	}
	line := make(chan string, 1)
	go func() { // ends when stdin does: the coordinator closes it, or exits
		l, _ := bufio.NewReader(stdin).ReadString('\n')
		line <- l
	}()
	select {
	case <-ctx.Done():
		return time.Time{}, ctx.Err()
	case l := <-line:
		ns, err := strconv.ParseInt(strings.TrimSpace(l), 10, 64)
		if err != nil {
			return time.Time{}, fmt.Errorf("start from the coordinator: %q: %w", l, err)
		}
		return time.Unix(0, ns), nil
	}
}

// readyLine is what a worker prints once it is connected.
const readyLine = "ready"

// startMargin is how long after the last worker is ready the run starts:
// time to hand every worker the start.
const startMargin = 250 * time.Millisecond

// workerCommand returns the command of worker process p: this program with
// -role worker, the Redis URL (which may hold a password) in its
// environment rather than its arguments, stopped with SIGTERM (then killed
// after a grace period) when ctx ends, and, on Linux, when the coordinator
// dies.
func workerCommand(ctx context.Context, self, url, key string, clients int, o options) *exec.Cmd {
	cmd := exec.CommandContext(ctx, self, "-role", "worker", "-key", key,
		"-clients", strconv.Itoa(max(1, clients)), "-rate", strconv.Itoa(o.rate), "-burst", strconv.Itoa(o.burst),
		"-period", o.period.String(), "-duration", o.duration.String(), "-max-wait", o.maxWait.String())
	cmd.Env = append(os.Environ(), redisURLEnv+"="+url)
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 5 * time.Second
	cmd.SysProcAttr = workerProcAttr()
	return cmd
}

// coordinate starts o.processes worker processes of this program against
// one Redis (an embedded one, served on loopback, unless -redis is given),
// starts them together once all are connected, waits for them, and prints
// each one's row and the combined figures (as JSON with -json). When ctx
// ends (SIGINT, SIGTERM) the workers are stopped.
func coordinate(ctx context.Context, o options, stdout, stderr io.Writer) error {
	ropts, where, closeRedis, err := connect(o.redisURL)
	if err != nil {
		return err
	}
	defer closeRedis()
	if err := reach(ctx, ropts, where); err != nil {
		return err
	}
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
	if !o.json {
		fmt.Fprintf(stdout, "slotbook demo, distributed: %d clients in %d processes share %v for %v (%s)\n\n",
			o.clients, o.processes, limit, o.duration, where)
	}

	results := make([]contention.Result, o.processes)
	g, gctx := errgroup.WithContext(ctx)
	ready := make(chan struct{}, o.processes)
	var start time.Time
	begin := make(chan struct{}) // closed once start is set
	for p := 0; p < o.processes; p++ {
		// The clients are shared out between the processes.
		clients := o.clients / o.processes
		if p < o.clients%o.processes {
			clients++
		}
		g.Go(func() error {
			var errb bytes.Buffer
			cmd := workerCommand(gctx, self, url, key, clients, o)
			cmd.Stderr = &errb
			stdin, err := cmd.StdinPipe()
			if err != nil {
				return err
			}
			out, err := cmd.StdoutPipe()
			if err != nil {
				return err
			}
			if err := cmd.Start(); err != nil {
				return fmt.Errorf("worker process %d: %w", p, err)
			}
			failed := func(err error) error {
				_ = stdin.Close()
				werr := cmd.Wait()
				return fmt.Errorf("worker process %d: %w: %v %s", p, err, werr, strings.TrimSpace(errb.String()))
			}
			r := bufio.NewReader(out)
			if l, err := r.ReadString('\n'); err != nil || strings.TrimSpace(l) != readyLine {
				return failed(fmt.Errorf("not ready (%q, %v)", l, err))
			}
			ready <- struct{}{}
			select {
			case <-begin:
			case <-gctx.Done():
				return failed(gctx.Err())
			}
			if _, err := fmt.Fprintln(stdin, start.UnixNano()); err != nil {
				return failed(err)
			}
			_ = stdin.Close()
			body, err := io.ReadAll(r)
			if err != nil {
				return failed(err)
			}
			if err := cmd.Wait(); err != nil {
				return fmt.Errorf("worker process %d: %w: %s", p, err, strings.TrimSpace(errb.String()))
			}
			return json.Unmarshal(body, &results[p])
		})
	}
	// Start once every worker is connected: a process slow to start (a
	// busy machine) cannot miss the run.
	g.Go(func() error {
		for range o.processes {
			select {
			case <-ready:
			case <-gctx.Done():
				return nil // the failing worker's error is the group's
			}
		}
		start = time.Now().Add(startMargin)
		close(begin)
		return nil
	})
	if err := g.Wait(); err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("stopped (workers stopped too): %w", ctx.Err())
		}
		return err
	}
	combined := combine(results, limit)
	if o.json {
		return json.NewEncoder(stdout).Encode(distributedJSON{Processes: results, Combined: combined})
	}
	tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "process\tthrough\tredis calls\trefusals\tcalls/request\tmean spacing\tmin spacing\t")
	for p, r := range append(results, combined.Result) {
		name := strconv.Itoa(p + 1)
		if p == len(results) {
			name = "all"
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%s\t%s\t%s\t\n", name, r.Through, r.Calls, r.Denials,
			perRequest(r), spacing(r.MeanSpacing, r), spacing(r.MinSpacing, r))
	}
	tw.Flush()
	fmt.Fprintf(stdout, "\ncombined rate %.3f/s against a limit of %.3f/s: %+.2f%%\n",
		combined.Rate, combined.Limit, 100*(combined.Rate-combined.Limit)/combined.Limit)
	return nil
}

// distributedJSON is -processes -json's output: one object.
type distributedJSON struct {
	Processes []contention.Result `json:"processes"`
	Combined  Combined            `json:"combined"`
}

// Combined is a distributed run's figures over every process.
type Combined struct {
	contention.Result
	Rate  float64 `json:"rate"`  // starts per second after the first burst
	Limit float64 `json:"limit"` // the configured rate, per second
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
