package main

import (
	"bytes"
	"context"
	"encoding/json"
	"image/png"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/contention"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/internal/timing"
	"github.com/slotbook/slotbook/metrics"
	"github.com/slotbook/slotbook/throttle"
)

func TestMain(m *testing.M) {
	// TestCoordinatorSIGTERM runs this binary as the program itself.
	if os.Getenv(asProgramEnv) == "1" {
		main()
	}
	// Distributed mode starts this binary as its workers.
	if len(os.Args) > 2 && os.Args[1] == "-role" {
		os.Exit(run(context.Background(), os.Args[1:], os.Stdout, os.Stderr))
	}
	redistest.Main(m)
}

// asProgramEnv, set to 1, makes the test binary run as demo-worker itself.
const asProgramEnv = "SLOTBOOK_DEMO_AS_PROGRAM"

func TestBadFlags(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{
		{"-clients", "0"}, {"-rate", "0"}, {"-burst", "-1"}, {"-period", "0s"},
		{"-duration", "-1s"}, {"-max-wait", "-1s"}, {"-modes", "retry,bogus"},
		{"-redis", "http://x"}, {"stray"}, {"-nosuchflag"}, {"-plot", "x.jpg"}, {"-processes", "-1"},
		{"-role", "boss"}, {"-role", "worker"},
	} {
		t.Run(strings.Join(args, " "), func(t *testing.T) {
			var out, errb bytes.Buffer
			code := run(context.Background(), args, &out, &errb)
			require.Equal(t, 2, code, "stderr: %s", errb.String())
			require.Equal(t, 1, strings.Count(errb.String(), "\n"), "one line: %q", errb.String())
			require.True(t, strings.HasPrefix(errb.String(), "demo-worker: "), errb.String())
		})
	}
}

// TestDemoJSON runs the three modes briefly on a real Redis and checks the
// headline: reservation costs one call per request, retrying costs more.
func TestDemoJSON(t *testing.T) {
	srv := redistest.Shared(t)
	srv.RequireReal(t)
	var out, errb bytes.Buffer
	code := run(context.Background(), []string{
		"-redis", "redis://" + srv.Addr, "-clients", "10", "-duration", "1s", "-max-wait", "1s", "-json",
	}, &out, &errb)
	require.Equal(t, 0, code, "stderr: %s", errb.String())
	dec := json.NewDecoder(&out)
	got := map[string]contention.Result{}
	for dec.More() {
		var r contention.Result
		require.NoError(t, dec.Decode(&r))
		got[r.Mode] = r
	}
	require.Len(t, got, 3)
	res, retry, pl := got["reserve"], got["retry"], got["pool"]
	require.Positive(t, res.Through)
	require.LessOrEqual(t, res.CallsPerRequest, 1.0, "reservation: at most one call per request")
	require.Zero(t, res.Denials)
	require.Greater(t, retry.CallsPerRequest, 3.0, "retry-after-denial stampedes")
	require.Positive(t, pl.Through)
	require.Less(t, pl.CallsPerRequest, 1.0, "the pool books in batches")
	require.Zero(t, pl.Denials)
}

// TestDemoTable runs the default table output on the embedded Redis.
func TestDemoTable(t *testing.T) {
	var out, errb bytes.Buffer
	code := run(context.Background(), []string{"-clients", "4", "-duration", "500ms", "-modes", "reserve"}, &out, &errb)
	require.Equal(t, 0, code, "stderr: %s", errb.String())
	s := out.String()
	require.Contains(t, s, "embedded Redis")
	require.Contains(t, s, "calls/request")
	require.Regexp(t, `reserve\s+\d+\s+\d+\s+0\s+1\.00`, s)
}

// TestDistributed starts three worker processes (this test binary, see
// TestMain) on one real Redis: the combined rate is the limit, within 2%
// on a quiet machine. The rate is measured from the starts, each as late
// after its slot as the machine wakes it: the tolerance grows by twice the
// worst lateness a plain timer showed alongside, spread over the starts.
func TestDistributed(t *testing.T) {
	srv := redistest.Shared(t)
	srv.RequireReal(t)
	const limit, burst = 20.0, 2
	var out, errb bytes.Buffer
	control := timing.Control(t)
	code := run(context.Background(), []string{
		"-redis", "redis://" + srv.Addr, "-processes", "3", "-clients", "9", "-rate", "20", "-burst", strconv.Itoa(burst),
		"-duration", "1500ms", "-max-wait", "1s",
	}, &out, &errb)
	timerLate := control()
	require.Equal(t, 0, code, "stderr: %s", errb.String())
	m := regexp.MustCompile(`combined rate ([0-9.]+)/s against a limit of 20.000/s`).FindStringSubmatch(out.String())
	require.NotNil(t, m, out.String())
	rate, err := strconv.ParseFloat(m[1], 64)
	require.NoError(t, err)
	all := regexp.MustCompile(`(?m)^\s+all\s+(\d+)\s+\d+\s+0\s+1\.00`).FindStringSubmatch(out.String())
	require.NotNil(t, all, out.String())
	through, err := strconv.Atoi(all[1])
	require.NoError(t, err)
	for _, p := range []string{"1", "2", "3"} {
		require.Regexp(t, `(?m)^\s+`+p+`\s+[1-9]`, out.String(), "process %s got requests through", p)
	}

	// The rate is the gaps after the burst over the time they span: slots
	// exactly an interval apart, the first and last start each late by up
	// to the worst lateness. 2% of the span, as on a quiet machine, plus
	// twice the worst a plain timer was late alongside.
	require.NotEmpty(t, timerLate)
	gaps := float64(through - burst - 1)
	require.Positive(t, gaps, out.String())
	interval := time.Second / time.Duration(limit)
	span := time.Duration(gaps * float64(time.Second) / rate)
	tolerance := time.Duration(0.02*gaps*float64(interval)) + 2*timerLate[len(timerLate)-1]
	t.Logf("rate %.3f/s over %d starts: %v from the exact span, %v allowed", rate, through, span-time.Duration(gaps)*interval, tolerance)
	require.InDelta(t, float64(time.Duration(gaps)*interval), float64(span), float64(tolerance),
		"the combined rate is the limit:\n%s", out.String())
}

func TestPlot(t *testing.T) {
	path := filepath.Join(t.TempDir(), "timeline.png")
	var out, errb bytes.Buffer
	code := run(context.Background(), []string{"-clients", "4", "-duration", "300ms", "-plot", path}, &out, &errb)
	require.Equal(t, 0, code, "stderr: %s", errb.String())
	img, err := os.ReadFile(path)
	require.NoError(t, err)
	require.True(t, bytes.HasPrefix(img, []byte("\x89PNG\r\n\x1a\n")), "a PNG")
	cfg, err := png.DecodeConfig(bytes.NewReader(img))
	require.NoError(t, err)
	require.Greater(t, cfg.Width, cfg.Height, "modes side by side")
}

func TestMetricsEndpoint(t *testing.T) {
	m, err := metrics.New()
	require.NoError(t, err)
	var errb bytes.Buffer
	addr, stop, err := listenMetrics("127.0.0.1:0", m, &errb)
	require.NoError(t, err)
	defer stop()
	m.ObserveDecision("demo", throttle.Booked, 0)
	resp, err := http.Get("http://" + addr.String() + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.Contains(t, string(body), `slotbook_decisions_total{limiter="demo",outcome="booked"} 1`)
}
