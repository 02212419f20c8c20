package asynqadapter_test

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/asynqadapter"
	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// fleet is a run of real asynq servers, each a process of its own (this
// test binary run again as TestHelperFleetProcess), sharing one limit
// through a limiter Redis of their own, separate from asynq's.
type fleet struct {
	Servers     int           `json:"servers"`
	Concurrency int           `json:"concurrency"`
	Rate        int           `json:"rate"` // per second
	Burst       int           `json:"burst"`
	MaxWait     time.Duration `json:"max_wait"`
	Spread      bool          `json:"spread"`    // WithSpread
	Booked      time.Duration `json:"booked"`    // > 0: WithBookedRetries with this horizon
	TaskCheck   time.Duration `json:"taskcheck"` // asynq's TaskCheckInterval (0: its default, 1 s)
	// Filled in by run for the processes.
	SrvURL string `json:"srv_url"` // asynq's Redis
	LimURL string `json:"lim_url"` // the limiter's Redis
	Prefix string `json:"prefix"`
	Queue  string `json:"queue"`

	tasks, lastAttempt int // tasks enqueued at once; of them, with MaxRetry(0)
}

func (f fleet) limit() throttle.Limit { return throttle.PerSecond(f.Rate, f.Burst) }

// fleetReport is what a fleet process writes on its stdout, on one line
// after fleetMark, when it is told to stop (its stdin closed).
type fleetReport struct {
	Starts   []int64    `json:"starts"`   // handler starts, Unix nanoseconds
	Stalls   [][2]int64 `json:"stalls"`   // the control's stalls: [due, woke], Unix nanoseconds
	Attempts int64      `json:"attempts"` // middleware invocations
	Calls    int64      `json:"calls"`    // round trips to the limiter's Redis after it was ready
}

const (
	fleetEnv   = "SLOTBOOK_FLEET_PROCESS" // the fleet's JSON, for a fleet process
	fleetReady = "fleet-ready"
	fleetMark  = "fleet-report: "
)

type fleetResult struct {
	starts   []time.Time // handler starts, sorted
	steady   []time.Time // those a stall of their process did not hold up (see stalled), sorted
	attempts int64       // middleware invocations
	calls    int64       // round trips to the limiter's Redis
	archived int
	retried  int // tasks with Retried > 0
}

// fleetProc is one running fleet process.
type fleetProc struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	lines  chan string   // its stdout, line by line
	stderr *syncBuffer   // for the failure message
	exited chan struct{} // closed when it has exited
}

type syncBuffer struct {
	mu sync.Mutex // guards b
	b  strings.Builder
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// startFleetProc starts a fleet process for f. It is told to stop (its
// stdin closed) and, if still running 10 s later, killed when the test
// ends.
func startFleetProc(tb testing.TB, f fleet) *fleetProc {
	tb.Helper()
	cfg, err := json.Marshal(f)
	require.NoError(tb, err)
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperFleetProcess$", "-test.count=1", "-test.timeout=3m")
	cmd.Env = append(os.Environ(), fleetEnv+"="+string(cfg))
	// Buffered beyond the few lines a fleet process prints, so that the
	// reader never blocks and always reaches Wait.
	p := &fleetProc{cmd: cmd, lines: make(chan string, 1024), stderr: &syncBuffer{}, exited: make(chan struct{})}
	cmd.Stderr = p.stderr
	p.stdin, err = cmd.StdinPipe()
	require.NoError(tb, err)
	out, err := cmd.StdoutPipe()
	require.NoError(tb, err)
	require.NoError(tb, cmd.Start())
	go func() {
		sc := bufio.NewScanner(out)
		sc.Buffer(nil, 1<<24)
		for sc.Scan() {
			select {
			case p.lines <- sc.Text():
			default: // nobody reads that many lines
			}
		}
		close(p.lines)
		_ = cmd.Wait()
		close(p.exited)
	}()
	tb.Cleanup(func() {
		_ = p.stdin.Close()
		select {
		case <-p.exited:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-p.exited
		}
	})
	return p
}

// expect returns the rest of the first line starting with prefix,
// skipping other lines, or fails the test.
func (p *fleetProc) expect(tb testing.TB, prefix string, within time.Duration) string {
	tb.Helper()
	timeout := time.After(within)
	for {
		select {
		case line, ok := <-p.lines:
			if !ok {
				tb.Fatalf("fleet process %d ended without %q; stderr:\n%s", p.cmd.Process.Pid, prefix, p.stderr.String())
			}
			if strings.HasPrefix(line, prefix) {
				return strings.TrimPrefix(line, prefix)
			}
		case <-timeout:
			tb.Fatalf("no %q from fleet process %d within %v; stderr:\n%s", prefix, p.cmd.Process.Pid, within, p.stderr.String())
		}
	}
}

// run starts the fleet's processes, enqueues its tasks once every server
// is up, waits until each has completed (or been archived), stops the
// processes and gathers what they recorded.
func (f fleet) run(tb testing.TB) fleetResult {
	tb.Helper()
	srvRedis := redistest.Shared(tb)
	srvRedis.RequireReal(tb)
	limRedis := redistest.Start(tb) // used by the limiter only
	f.SrvURL = os.Getenv("SLOTBOOK_REDIS_URL")
	if f.SrvURL == "" {
		f.SrvURL = "redis://" + srvRedis.Addr
	}
	f.LimURL = "redis://" + limRedis.Addr
	f.Prefix = redistest.Prefix(tb)
	f.Queue = "q" + f.Prefix

	procs := make([]*fleetProc, f.Servers)
	for i := range procs {
		procs[i] = startFleetProc(tb, f)
	}
	for _, p := range procs {
		p.expect(tb, fleetReady, time.Minute)
	}

	client := asynq.NewClientFromRedisClient(srvRedis.Client(tb))
	var ids []string
	for i := 0; i < f.tasks; i++ {
		opts := []asynq.Option{asynq.Queue(f.Queue), asynq.Retention(time.Hour), asynq.Timeout(5 * time.Minute)}
		if every := f.tasks / max(1, f.lastAttempt); f.lastAttempt > 0 && i%every == 0 && i/every < f.lastAttempt {
			opts = append(opts, asynq.MaxRetry(0))
		}
		info, err := client.Enqueue(asynq.NewTask("api:call", []byte(fmt.Sprint(i))), opts...)
		require.NoError(tb, err)
		ids = append(ids, info.ID)
	}
	insp := asynq.NewInspectorFromRedisClient(srvRedis.Client(tb))
	// Generous: a busy machine; the limit alone needs tasks/rate.
	end := time.Now().Add(f.limit().Interval()*time.Duration(f.tasks)*3 + time.Minute)
	for {
		qi, err := insp.GetQueueInfo(f.Queue)
		require.NoError(tb, err)
		if qi.Completed+qi.Archived >= f.tasks {
			break
		}
		if time.Now().After(end) {
			tb.Fatalf("only %d of %d tasks completed (%d archived, %d pending, %d retry, %d active)",
				qi.Completed, f.tasks, qi.Archived, qi.Pending, qi.Retry, qi.Active)
		}
		time.Sleep(50 * time.Millisecond)
	}

	var r fleetResult
	for _, p := range procs {
		_ = p.stdin.Close()
	}
	for _, p := range procs {
		var rep fleetReport
		require.NoError(tb, json.Unmarshal([]byte(p.expect(tb, fleetMark, time.Minute)), &rep))
		for _, ns := range rep.Starts {
			r.starts = append(r.starts, time.Unix(0, ns))
			if !stalled(rep.Stalls, ns) {
				r.steady = append(r.steady, time.Unix(0, ns))
			}
		}
		r.attempts += rep.Attempts
		r.calls += rep.Calls
	}
	for _, p := range procs {
		select {
		case <-p.exited:
		case <-time.After(time.Minute):
			tb.Fatalf("fleet process %d did not exit; stderr:\n%s", p.cmd.Process.Pid, p.stderr.String())
		}
		// Its own TestMain checks for goroutines left behind.
		require.True(tb, p.cmd.ProcessState.Success(), "fleet process %d: %v; stderr:\n%s",
			p.cmd.Process.Pid, p.cmd.ProcessState, p.stderr.String())
	}
	slices.SortFunc(r.starts, func(a, b time.Time) int { return a.Compare(b) })
	slices.SortFunc(r.steady, func(a, b time.Time) int { return a.Compare(b) })
	for _, id := range ids {
		ti, err := insp.GetTaskInfo(f.Queue, id)
		require.NoError(tb, err)
		if ti.State == asynq.TaskStateArchived {
			r.archived++
		}
		if ti.Retried > 0 {
			r.retried++
		}
	}
	return r
}

// TestHelperFleetProcess is not a test: it is one asynq server of a
// fleet (see fleet.run), run in a process of its own when fleetEnv is
// set. It builds its own Redis clients, engine, limiter, middleware and
// asynq.Server, says fleetReady once serving, records when its handler
// starts each task, and when its stdin closes (the parent said stop, or
// died) shuts down and writes its fleetReport.
func TestHelperFleetProcess(t *testing.T) {
	cfg := os.Getenv(fleetEnv)
	if cfg == "" {
		t.Skip("a fleet process, run by the fleet tests")
	}
	var f fleet
	require.NoError(t, json.Unmarshal([]byte(cfg), &f))
	client := func(url string) *redis.Client {
		opts, err := redis.ParseURL(url)
		require.NoError(t, err)
		opts.ContextTimeoutEnabled = true
		c := redis.NewClient(opts)
		t.Cleanup(func() { _ = c.Close() })
		return c
	}
	limRDB := client(f.LimURL)
	calls := callcount.Attach(limRDB)
	eng, err := throttle.New(limRDB, throttle.WithPrefix(f.Prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	redistest.UntilOK(t, func() error { return eng.Load(context.Background()) })
	lim, err := reserve.New(eng, "fleet", f.limit(), reserve.WithMaxWait(f.MaxWait))
	require.NoError(t, err)
	opts := []asynqadapter.Option{asynqadapter.WithCheckInterval(time.Second), asynqadapter.WithSpread(f.Spread)}
	if f.Booked > 0 {
		opts = append(opts, asynqadapter.WithBookedRetries(eng, f.Booked))
	}
	mw, err := asynqadapter.NewMiddleware(lim, opts...)
	require.NoError(t, err)

	var (
		mu       sync.Mutex // guards starts
		starts   []int64
		attempts atomic.Int64
	)
	count := func(next asynq.Handler) asynq.Handler {
		return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
			attempts.Add(1)
			return next.ProcessTask(ctx, t)
		})
	}
	srv := asynq.NewServerFromRedisClient(client(f.SrvURL), asynq.Config{
		Concurrency:              f.Concurrency,
		Queues:                   map[string]int{f.Queue: 1},
		IsFailure:                asynqadapter.IsFailure,
		RetryDelayFunc:           asynqadapter.RetryDelayFunc(nil),
		DelayedTaskCheckInterval: time.Second,
		TaskCheckInterval:        f.TaskCheck,
		LogLevel:                 asynq.ErrorLevel,
		ShutdownTimeout:          5 * time.Second,
	})
	mux := asynq.NewServeMux()
	mux.Use(count, mw)
	mux.HandleFunc("api:call", func(context.Context, *asynq.Task) error {
		now := time.Now().UnixNano()
		mu.Lock()
		starts = append(starts, now)
		mu.Unlock()
		return nil
	})
	require.NoError(t, srv.Start(mux))
	base := calls.Load()
	stop := stallControl()
	fmt.Println(fleetReady)

	_, _ = io.Copy(io.Discard, os.Stdin) // until told to stop
	srv.Shutdown()
	mu.Lock()
	rep := fleetReport{Starts: starts, Stalls: stop(), Attempts: attempts.Load(), Calls: calls.Load() - base}
	mu.Unlock()
	out, err := json.Marshal(rep)
	require.NoError(t, err)
	fmt.Println(fleetMark + string(out))
}

const (
	controlTick  = 5 * time.Millisecond  // the control sleeps this long at a time
	controlStall = 20 * time.Millisecond // a wake-up later than this is a stall
)

// stallControl starts the control of a fleet process: a goroutine that
// sleeps controlTick at a time and records each wake-up more than
// controlStall late, as [due, woke]: a stretch in which the process's
// goroutines did not run when due (a busy machine, the race detector, a
// garbage collection). stop ends it and returns the stalls.
func stallControl() (stop func() [][2]int64) {
	quit, done := make(chan struct{}), make(chan [][2]int64)
	go func() {
		var stalls [][2]int64
		for {
			due := time.Now().Add(controlTick)
			select {
			case <-quit:
				done <- stalls
				return
			case <-time.After(controlTick):
			}
			if woke := time.Now(); woke.Sub(due) > controlStall {
				stalls = append(stalls, [2]int64{due.UnixNano(), woke.UnixNano()})
			}
		}
	}()
	return func() [][2]int64 { close(quit); return <-done }
}

// stalled reports whether a handler start at ns may have been held up by
// one of its process's stalls: it lies within one, or within controlStall
// after its end (the handler's goroutine may run just after the control's).
func stalled(stalls [][2]int64, ns int64) bool {
	for _, st := range stalls {
		if ns >= st[0] && ns <= st[1]+int64(controlStall) {
			return true
		}
	}
	return false
}

// maxInWindow returns the most starts within any window of length w.
func maxInWindow(starts []time.Time, w time.Duration) int {
	most, j := 0, 0
	for i := range starts {
		for starts[i].Sub(starts[j]) >= w {
			j++
		}
		most = max(most, i-j+1)
	}
	return most
}

// rateFrom returns the start rate from the k-th start (1-based) to the last.
func rateFrom(starts []time.Time, k int) float64 {
	if len(starts) <= k {
		return 0
	}
	return float64(len(starts)-k) / starts[len(starts)-1].Sub(starts[k-1]).Seconds()
}

func (r fleetResult) String() string {
	n := len(r.starts)
	if n == 0 {
		return "no starts"
	}
	return fmt.Sprintf("%d starts: %.2f attempts per task, %.2f limiter calls per task, most starts in 1 s: %d "+
		"(%d not counting the %d a stall may have held up), rate from the 25th start: %.2f/s, elapsed %v",
		n, float64(r.attempts)/float64(n), float64(r.calls)/float64(n), maxInWindow(r.starts, time.Second),
		maxInWindow(r.steady, time.Second), n-len(r.steady),
		rateFrom(r.starts, 25), r.starts[n-1].Sub(r.starts[0]).Round(time.Millisecond))
}

// requireWindow checks that no 1 s window holds more than rate+burst+1
// starts, not counting starts that a stall of their process may have held
// up (see stallControl): a busy machine can hold a handler's goroutine
// past its slot and let it start together with later ones, which says
// nothing of the limiter. Most starts must be judged.
func requireWindow(t *testing.T, f fleet, r fleetResult) {
	t.Helper()
	require.GreaterOrEqual(t, len(r.steady), len(r.starts)/2, "starts not held up by a stall (too busy a machine to judge)")
	require.LessOrEqual(t, maxInWindow(r.steady, time.Second), f.Rate+f.Burst+1,
		"starts in a 1 s window, not counting those a stall may have held up")
}

// BenchmarkSpreadThroughAsynq measures what spreading refused tasks does
// through a real asynq server: 30 tasks enqueued at once, one server of 10
// workers, 20/s, a 200ms max wait. It reports handler attempts per task
// with spreading on and off (the README's figure).
//
//	go test -run XXX -bench SpreadThroughAsynq -benchtime 1x ./asynqadapter
func BenchmarkSpreadThroughAsynq(b *testing.B) {
	for _, spread := range []bool{false, true} {
		b.Run(fmt.Sprint("spread=", spread), func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				r := fleet{Servers: 1, Concurrency: 10, Rate: 20, MaxWait: 200 * time.Millisecond, Spread: spread,
					tasks: 30}.run(b)
				b.ReportMetric(float64(r.attempts)/30, "attempts/task")
				b.ReportMetric(float64(r.calls)/30, "calls/task")
			}
		})
	}
}

var fullFleet = flag.Bool("asynq.full", false, "run the fleet tests at the full size of issue 15 (320 tasks)")

// TestFleet: three asynq server processes (Concurrency 10,
// DelayedTaskCheckInterval 1 s) share 20/s burst 4 with a 500ms max wait,
// without booked retries; tasks are enqueued at once, one in 16 with
// MaxRetry(0). No task is lost, archived or charged a retry, and starts
// keep to the limit: at most rate+burst+1 in any second (requireWindow).
// The rest is logged. CI size: 80 tasks; -asynq.full: 320.
func TestFleet(t *testing.T) {
	if testing.Short() {
		t.Skip("10 s: skipped with -short")
	}
	t.Parallel()
	tasks := 80
	if *fullFleet {
		tasks = 320
	}
	f := fleet{Servers: 3, Concurrency: 10, Rate: 20, Burst: 4, MaxWait: 500 * time.Millisecond, Spread: true,
		tasks: tasks, lastAttempt: tasks / 16}
	r := f.run(t)
	t.Log(r)
	require.Len(t, r.starts, tasks, "every task ran once")
	require.Zero(t, r.archived, "archived")
	require.Zero(t, r.retried, "tasks with Retried > 0")
	requireWindow(t, f, r)
}

var (
	fleetTasks     = flag.Int("asynq.tasks", 0, "tasks for TestFleetBooked (0: its CI size, or 320 with -asynq.full)")
	fleetTaskCheck = flag.Duration("asynq.taskcheck", 100*time.Millisecond, "asynq's TaskCheckInterval for TestFleetBooked")
)

// TestFleetBooked is TestFleet with booked retries (WithBookedRetries,
// horizon one minute) and asynq's TaskCheckInterval at 100ms, judged on
// issue 15's targets: no task lost, archived or charged a retry; at most
// rate+burst+1 starts in any second (requireWindow); a start rate from
// the 25th start to the last of at least 0.97 times the limit's; and one
// call to the limiter's Redis (its own server, apart from asynq's) per
// attempt, counted in each process and summed, plus one for each task
// taken up too late for its booked slot, which books again: at most a
// tenth of the tasks (0 to 1 in 100 at this size, 11 in 100 with asynq's
// TaskCheckInterval of 1 s). Issue 15 also
// asked for at most 1.2 calls per task, which booked retries met (1.06 to
// 1.18) while a returning task ran at a booking its process had kept from
// an earlier reply, with no call: a task cut short by a server's shutdown
// and run again as the same attempt could then run twice on one slot
// (TestReviewASRequeuedTaskRunsTwiceOnOneSlot). Every returning task now
// recalls its booking, taking it out of the index: one call per attempt
// (1.79 per task here). CI size: 160 tasks, 8 s of
// slots (at 80, one late start moves the rate by 2%); -asynq.full: 320;
// -asynq.tasks and -asynq.taskcheck for other runs.
//
// With asynq's default TaskCheckInterval (1 s) the rate falls short: an
// idle asynq processor sleeps 0.5 to 1.5 s after each empty poll, so a
// task moved back to its queue waits up to that long for a worker on top
// of the forwarder's phase (up to DelayedTaskCheckInterval), more than the
// one interval before its slot that it was sent back for; it comes back
// late and books again. Sending it back earlier makes each task hold a
// worker that much longer, and 3 x 10 workers at 20/s leave 1.5 s per
// task (the README has the figures).
func TestFleetBooked(t *testing.T) {
	if testing.Short() {
		t.Skip("10 s: skipped with -short")
	}
	// Not parallel: it runs alone in its package, on a machine busy enough.
	tasks := 160
	if *fullFleet {
		tasks = 320
	}
	if *fleetTasks > 0 {
		tasks = *fleetTasks
	}
	f := fleet{Servers: 3, Concurrency: 10, Rate: 20, Burst: 4, MaxWait: 500 * time.Millisecond, Spread: true,
		Booked: time.Minute, TaskCheck: *fleetTaskCheck, tasks: tasks, lastAttempt: tasks / 16}
	r := f.run(t)
	t.Log(r)
	require.Len(t, r.starts, tasks, "every task ran once")
	require.Zero(t, r.archived, "archived")
	require.Zero(t, r.retried, "tasks with Retried > 0")
	requireWindow(t, f, r)
	require.LessOrEqual(t, r.calls, r.attempts+int64(tasks/10), "limiter calls: one per attempt, and one per task taken up too late for its slot")
	require.GreaterOrEqual(t, rateFrom(r.starts, 25), 0.97*float64(f.Rate), "start rate from the 25th start")
}
