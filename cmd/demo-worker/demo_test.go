package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/contention"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/metrics"
	"github.com/slotbook/slotbook/throttle"
)

// TestMetricsLabelledByMode: with -metrics, each mode's decisions count
// under a label of its own, not all under one.
func TestMetricsLabelledByMode(t *testing.T) {
	t.Parallel()
	mr := miniredis.RunT(t)
	m, err := metrics.New()
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	require.NoError(t, reg.Register(m))
	o := options{clients: 2, duration: 300 * time.Millisecond, maxWait: time.Second}
	limit := throttle.PerSecond(20, 2)
	ropts := &redis.Options{Addr: mr.Addr(), ContextTimeoutEnabled: true}
	ctx := context.Background()
	for _, mode := range []string{"retry", "reserve"} {
		r, err := newModeRun(ctx, mode, ropts, "t:", limit, o, m)
		require.NoError(t, err)
		t.Cleanup(func() { _ = r.rdb.Close() })
		require.NoError(t, r.run(ctx))
	}
	families, err := reg.Gather()
	require.NoError(t, err)
	labels := map[string]bool{}
	for _, f := range families {
		if f.GetName() != "slotbook_decisions_total" {
			continue
		}
		for _, s := range f.GetMetric() {
			for _, l := range s.GetLabel() {
				if l.GetName() == "limiter" {
					labels[l.GetValue()] = true
				}
			}
		}
	}
	require.Equal(t, map[string]bool{"demo-retry": true, "demo-reserve": true}, labels)
}

// TestProcessesFlags: -processes runs the reserve mode only, and says so
// rather than ignoring -modes; it refuses -plot and -metrics.
func TestProcessesFlags(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{
		{"-processes", "2", "-modes", "retry"},
		{"-processes", "2", "-modes", "reserve,pool"},
		{"-processes", "2", "-plot", "x.png"},
		{"-processes", "2", "-metrics", "127.0.0.1:0"},
	} {
		t.Run(strings.Join(args, " "), func(t *testing.T) {
			var out, errb bytes.Buffer
			require.Equal(t, 2, run(context.Background(), args, &out, &errb), "stderr: %s", errb.String())
			require.Contains(t, errb.String(), "-processes")
		})
	}
	_, err := parseFlags([]string{"-processes", "2", "-modes", "reserve", "-json"}, &bytes.Buffer{})
	require.NoError(t, err)
}

// TestDistributedJSON: -processes with -json prints one JSON object with
// each process's result and the combined figures.
func TestDistributedJSON(t *testing.T) {
	srv := redistest.Shared(t)
	srv.RequireReal(t)
	var out, errb bytes.Buffer
	code := run(context.Background(), []string{
		"-redis", "redis://" + srv.Addr, "-processes", "2", "-clients", "2", "-rate", "20", "-burst", "1",
		"-duration", "300ms", "-max-wait", "1s", "-json",
	}, &out, &errb)
	require.Equal(t, 0, code, "stderr: %s", errb.String())
	var got distributedJSON
	dec := json.NewDecoder(&out)
	require.NoError(t, dec.Decode(&got), out.String())
	require.False(t, dec.More(), "one object")
	require.Len(t, got.Processes, 2)
	require.Equal(t, got.Processes[0].Through+got.Processes[1].Through, got.Combined.Through)
	require.Positive(t, got.Combined.Through)
	require.Equal(t, 20.0, got.Combined.Limit)
}

// TestRedisDown: with nothing listening at -redis, the demo says why
// (connection refused), not that a later call timed out.
func TestRedisDown(t *testing.T) {
	t.Parallel()
	addr := refusedAddr(t)
	for _, args := range [][]string{{}, {"-processes", "2"}} {
		var out, errb bytes.Buffer
		code := run(context.Background(), append([]string{"-redis", "redis://" + addr, "-duration", "1s"}, args...), &out, &errb)
		require.Equal(t, 1, code, "stderr: %s", errb.String())
		require.Contains(t, errb.String(), "connection refused")
		require.NotContains(t, errb.String(), "deadline exceeded")
	}
}

// TestRowsWithoutStarts: a row with no request through shows "-" for
// calls per request and spacing, not 0.00 for calls that were made.
func TestRowsWithoutStarts(t *testing.T) {
	t.Parallel()
	require.Equal(t, "-", perRequest(contention.Result{Through: 0, Calls: 11}))
	require.Equal(t, "11.00", perRequest(contention.Result{Through: 1, Calls: 11}))
	require.Equal(t, "2.50", perRequest(contention.Result{Through: 4, Calls: 10}))
	var out bytes.Buffer
	printTable(&out, []contention.Result{{Mode: "reserve", Calls: 11, Denials: 11}})
	require.Regexp(t, `reserve\s+0\s+11\s+11\s+-\s+-\s+-`, out.String())
	require.NotContains(t, out.String(), "0.00")
}

// TestWorkerCommandHidesPassword: the Redis URL, which may hold a
// password, reaches a worker through its environment, not its arguments.
func TestWorkerCommandHidesPassword(t *testing.T) {
	t.Parallel()
	url := "redis://:s3cret@127.0.0.1:6379/0"
	cmd := workerCommand(context.Background(), "/bin/true", url, "k", 2, options{rate: 10, burst: 1, period: time.Second, duration: time.Second})
	for _, a := range cmd.Args {
		require.NotContains(t, a, "s3cret")
	}
	require.Contains(t, cmd.Env, redisURLEnv+"="+url)
}

// TestCoordinatorSIGTERM runs the program (this test binary) as a
// coordinator of two workers on a password-protected Redis, checks that
// no worker's command line shows the password, sends the coordinator
// SIGTERM, and checks that its workers are gone.
func TestCoordinatorSIGTERM(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("reads /proc")
	}
	t.Parallel()
	srv := redistest.Start(t)
	require.NoError(t, srv.Client(t).ConfigSet(context.Background(), "requirepass", "s3cret").Err())
	self, err := os.Executable()
	require.NoError(t, err)
	cmd := exec.Command(self, "-redis", "redis://:s3cret@"+srv.Addr, "-processes", "2", "-clients", "2",
		"-duration", "5m", "-quiet")
	cmd.Env = append(os.Environ(), asProgramEnv+"=1")
	errb := &lockedBuffer{}
	cmd.Stderr = errb
	require.NoError(t, cmd.Start())
	coordinator := cmd.Process.Pid
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	var workers []int
	t.Cleanup(func() { // whatever happens, leave nothing running
		_ = cmd.Process.Kill()
		for _, p := range workers {
			_ = syscall.Kill(p, syscall.SIGKILL)
		}
	})

	// Wait (on a busy machine, for as long as it takes) for both workers
	// to be running: started, and booking (so past the start, when the
	// coordinator no longer talks to them).
	admin := srv.Options()
	admin.Password = "s3cret"
	rdb := redis.NewClient(admin)
	t.Cleanup(func() { _ = rdb.Close() })
	booking := func() bool {
		n, err := rdb.DBSize(context.Background()).Result()
		return err == nil && n > 0
	}
	deadline := time.Now().Add(time.Minute)
	for len(workers) < 2 || !booking() {
		if !time.Now().Before(deadline) {
			t.Fatalf("workers not running: %s", errb.String())
		}
		workers = children(t, coordinator)
		time.Sleep(20 * time.Millisecond)
	}
	for _, p := range workers {
		argv, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(p), "cmdline"))
		require.NoError(t, err)
		require.Contains(t, string(argv), "-role")
		require.NotContains(t, string(argv), "s3cret", "the password is not on a worker's command line")
	}

	require.NoError(t, syscall.Kill(coordinator, syscall.SIGTERM))
	select {
	case <-exited:
	case <-time.After(time.Minute):
		t.Fatal("the coordinator did not exit on SIGTERM")
	}
	// A worker stops within moments; 30 s leaves a busy machine room.
	stopped := time.Now().Add(30 * time.Second)
	for _, p := range workers {
		for !gone(p) {
			require.True(t, time.Now().Before(stopped), "worker %d still running after the coordinator's SIGTERM", p)
			time.Sleep(20 * time.Millisecond)
		}
	}
}

// children returns the pids of pid's child processes.
func children(t *testing.T, pid int) []int {
	t.Helper()
	tasks, err := filepath.Glob(filepath.Join("/proc", strconv.Itoa(pid), "task", "*", "children"))
	require.NoError(t, err)
	var out []int
	for _, f := range tasks {
		b, err := os.ReadFile(f)
		if err != nil {
			continue // the thread ended
		}
		for _, s := range strings.Fields(string(b)) {
			p, err := strconv.Atoi(s)
			require.NoError(t, err)
			out = append(out, p)
		}
	}
	return out
}

// gone reports whether process pid has exited (no longer exists, or is a
// zombie nobody has reaped yet).
func gone(pid int) bool {
	f, err := os.Open(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return true
	}
	defer f.Close()
	line, _ := bufio.NewReader(f).ReadString('\n')
	// pid (comm) state ...: the state follows the last ')'.
	i := strings.LastIndexByte(line, ')')
	return i < 0 || i+2 >= len(line) || line[i+2] == 'Z' || line[i+2] == 'X'
}

// lockedBuffer is a bytes.Buffer safe for a writer and a reader at once.
type lockedBuffer struct {
	mu sync.Mutex // guards b
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
