package lease_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/lease/internal/leasetest"
)

// proc is a child process of the test (see child in main_test.go).
type proc struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	lines chan string   // its stdout, line by line; closed at EOF
	done  chan struct{} // closed at its exit
	err   error         // its exit status, once done is closed
}

// wait waits for the child to exit and returns its exit status.
func (p *proc) wait() error {
	<-p.done
	return p.err
}

// spawn starts this test binary again as a child in mode.
func spawn(t *testing.T, e *leasetest.Env, mode, key string, n int, ttl time.Duration, extra ...string) *proc {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(),
		"LEASE_CHILD="+mode, "LEASE_ADDR="+e.Srv.Addr, "LEASE_PREFIX="+e.Prefix,
		"LEASE_KEY="+key, "LEASE_N="+strconv.Itoa(n), "LEASE_TTL="+ttl.String())
	cmd.Env = append(cmd.Env, extra...)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	p := &proc{cmd: cmd, stdin: stdin, lines: make(chan string, 1<<16), done: make(chan struct{})}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			p.lines <- sc.Text()
		}
		close(p.lines)
		p.err = cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill() // by its pid; a no-op once it has exited
		_ = p.wait()
	})
	return p
}

// expect waits for a line starting with prefix and returns it.
func (p *proc) expect(t *testing.T, prefix string) string {
	t.Helper()
	timeout := time.After(2 * time.Minute)
	for {
		select {
		case l, ok := <-p.lines:
			if !ok {
				t.Fatalf("child ended before saying %q", prefix)
			}
			if strings.HasPrefix(l, prefix) {
				return l
			}
		case <-timeout:
			t.Fatalf("child never said %q", prefix)
		}
	}
}

// TestAtMostNAcrossProcesses runs 8 processes of 25 workers on one key
// with N = 5 for over 5 s. Each holder records when it held its lease
// (after Acquire returned, before Release was called: inside its real
// holding), on the machine's wall clock, which every process shares; at
// no instant may more than 5 recorded holdings overlap.
func TestAtMostNAcrossProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("multi-process run of several seconds")
	}
	e := leasetest.NewEnv(t)
	const procs, workers, n = 8, 25, 5
	// A TTL far beyond any stall of a busy machine: this test is about
	// the limit, not about lapses (a lapse would be reported as "lost").
	ttl := 30 * time.Second
	var ps []*proc
	for range procs {
		ps = append(ps, spawn(t, e, "stress", "shared", n, ttl,
			"LEASE_WORKERS="+strconv.Itoa(workers), "LEASE_RUN=6s"))
	}
	var ivs []rvIv
	var first, last int64
	holds := 0
	tokens := map[int64]bool{}
	for i, p := range ps {
		for l := range p.lines {
			f := strings.Fields(l)
			switch f[0] {
			case "lost":
				t.Errorf("process %d: a lease lapsed while held: %s", i, l)
			case "hold":
				start, _ := strconv.ParseInt(f[1], 10, 64)
				stop, _ := strconv.ParseInt(f[2], 10, 64)
				token, _ := strconv.ParseInt(f[3], 10, 64)
				if tokens[token] {
					t.Errorf("fencing token %d granted twice", token)
				}
				tokens[token] = true
				ivs = append(ivs, rvIv{from: time.Duration(start), to: time.Duration(stop), tok: token})
				if first == 0 || start < first {
					first = start
				}
				last = max(last, stop)
				holds++
			}
		}
		require.NoError(t, p.wait(), "process %d", i)
	}
	// Ends before starts at the same instant: the recorded holdings are
	// inside the real ones, which cannot touch.
	peak, _ := rvPeak(ivs, n)
	span := time.Duration(last - first)
	t.Logf("%d holdings over %v by %d processes x %d workers, at most %d at once", holds, span, procs, workers, peak)
	if peak > n {
		t.Errorf("%d holdings overlapped, want at most %d", peak, n)
	}
	if peak < 2 {
		t.Errorf("at most %d holding at once: the workers never contended, the test judged nothing", peak)
	}
	if span < 5*time.Second {
		t.Errorf("the holdings spanned %v, want at least 5s", span)
	}
}

// TestKilledHolderFreesWithinTTL SIGKILLs a process holding every lease of
// a key and judges, on the Redis clock, when the waiters of another
// process get them: no later than the TTL after the kill plus a second.
func TestKilledHolderFreesWithinTTL(t *testing.T) {
	e := leasetest.NewEnv(t)
	const n = 3
	ttl := 2 * time.Second
	holder := spawn(t, e, "hold", "k", n, ttl)
	holder.expect(t, "held")

	obs := &countingObserver{}
	// This process's TTL is long, so that its leases' expiry in Redis,
	// minus the TTL, is the moment they were granted (no extension comes
	// before the test reads them). Its poll is the default's bound or less.
	long := time.Minute
	s := e.Sem(t, n, lease.WithTTL(long), lease.WithPollInterval(250*time.Millisecond), lease.WithObserver(obs))
	ctx := context.Background()
	got := make(chan *lease.Lease, n)
	for range n {
		go func() {
			l, err := s.Acquire(ctx, "k")
			if err != nil {
				t.Error(err)
			}
			got <- l
		}()
	}
	e.Queued(t, "k", n)

	require.NoError(t, holder.cmd.Process.Signal(syscall.SIGKILL))
	_ = holder.wait()
	killed, err := e.Rdb.Time(ctx).Result()
	require.NoError(t, err)

	var leases []*lease.Lease
	for range n {
		select {
		case l := <-got:
			require.NotNil(t, l)
			leases = append(leases, l)
		case <-time.After(ttl + 30*time.Second):
			t.Fatalf("the killed holder's leases never came back (%d of %d)", len(leases), n)
		}
	}
	scores, err := e.Rdb.ZRangeWithScores(ctx, e.Key("k", "h"), 0, -1).Result()
	require.NoError(t, err)
	require.Len(t, scores, n)
	var granted time.Time
	for _, z := range scores {
		at := time.UnixMicro(int64(z.Score)).Add(-long)
		if at.After(granted) {
			granted = at
		}
	}
	back := granted.Sub(killed)
	t.Logf("capacity back %v after the kill (Redis clock), TTL %v", back, ttl)
	if back > ttl+time.Second {
		t.Errorf("the killed holder's leases came back %v after the kill, want within TTL + 1s = %v", back, ttl+time.Second)
	}
	if got := obs.expired.Load(); got != n {
		t.Errorf("%d leases counted expired, want %d", got, n)
	}
	for _, l := range leases {
		require.NoError(t, l.Release(ctx))
	}
}

// TestFIFOAcrossProcesses queues waiters from four processes one after
// another (each in the queue before the next starts) behind a held lease
// of N = 1, then releases it: they must be granted in arrival order, which
// their fencing tokens (one counter, incremented at each grant) show.
func TestFIFOAcrossProcesses(t *testing.T) {
	e := leasetest.NewEnv(t)
	ttl := 30 * time.Second
	s := e.Sem(t, 1, lease.WithTTL(ttl))
	ctx := context.Background()
	held, err := s.Acquire(ctx, "k")
	require.NoError(t, err)
	const procs, waiters = 4, 12
	var ps []*proc
	for range procs {
		ps = append(ps, spawn(t, e, "fifo", "k", 1, ttl))
	}
	for i := range waiters {
		_, err := fmt.Fprintf(ps[i%procs].stdin, "go w%02d\n", i)
		require.NoError(t, err)
		e.Queued(t, "k", int64(i+1))
	}
	require.NoError(t, held.Release(ctx))
	type grant struct {
		name  string
		token int64
	}
	var (
		mu     sync.Mutex
		grants []grant
		wg     sync.WaitGroup
	)
	for _, p := range ps {
		require.NoError(t, p.stdin.Close())
		wg.Add(1)
		go func() {
			defer wg.Done()
			for l := range p.lines {
				f := strings.Fields(l)
				switch {
				case f[0] == "got" && len(f) == 3:
					tok, _ := strconv.ParseInt(f[2], 10, 64)
					mu.Lock()
					grants = append(grants, grant{f[1], tok})
					mu.Unlock()
				case f[0] == "error":
					t.Errorf("child: %s", l)
				}
			}
		}()
	}
	wg.Wait()
	for _, p := range ps {
		require.NoError(t, p.wait())
	}
	require.Len(t, grants, waiters)
	slices.SortFunc(grants, func(a, b grant) int { return int(a.token - b.token) })
	for i, g := range grants {
		if want := fmt.Sprintf("w%02d", i); g.name != want {
			t.Errorf("grant %d went to %s, want %s (arrival order); all: %v", i, g.name, want, grants)
			break
		}
	}
}
