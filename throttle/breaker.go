package throttle

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"
)

// ErrUnavailable is matched by errors for calls that did not reach a
// working Redis: a timeout, a refused or broken connection, a server that
// cannot serve (loading, out of memory, a read-only replica...), no
// connection free in the client's own pool, or the node's breaker open
// after such a failure. A fallback policy (package reserve) may answer
// instead. The package doc has the full table.
var ErrUnavailable = errors.New("throttle: Redis unavailable")

// Defaults for the breaker's probe interval, which doubles after each failed
// probe between the two.
const (
	DefaultProbeMin = 25 * time.Millisecond
	DefaultProbeMax = 400 * time.Millisecond
)

// breakers stop calls from paying the timeout while Redis is down, one
// breaker per Redis node (the failure domain): the client's address for a
// plain client, the master that owns the key's slot for a Cluster, the
// shard the key goes to for a Ring. After a
// failure a node's breaker is open, and calls to that node fail at once
// with ErrUnavailable, except one probe at a time, let through once the
// backoff has passed; the first success closes it. Calls to other nodes
// are not affected.
//
// While a breaker is closed a call takes no lock: allow and success read
// and write atomics only. Every change of state is made under the lock,
// and told to the observer under it, so an observer sees each node's
// openings and closings in the order they happened.
type breakers struct {
	min, max time.Duration
	obs      Observer
	nodeObs  NodeObserver // obs, if it is one; else nil

	mu    sync.Mutex // guards every breaker's state changes; held while the observer is told of a change
	nodes sync.Map   // node address -> *breaker; entries are never removed (one per node ever called)
	// nOpen counts the breakers open: written under mu, read without it
	// (anyOpen) by the sweeps, which a call makes only while one is.
	nOpen atomic.Int32
}

// breaker is one node's state.
type breaker struct {
	node string
	// open is written under breakers.mu and read without it on the fast
	// path; a reader that sees it set takes the lock to act on it.
	open atomic.Bool
	// past is set while a call of RunScriptPastBreaker is out that the
	// open breaker let by: one at a time, so that, Redis stopped, such
	// calls do not fail the client's dials one after another (go-redis
	// then fails every new dial at once, a probe's too, until a dial of
	// its own succeeds, up to a second after Redis is back: helper-135).
	past atomic.Bool
	// lastSuccess is when the last call to the node succeeded, in
	// monotonic nanoseconds (see monoNow), or 0.
	lastSuccess atomic.Int64

	// Guarded by breakers.mu:
	probing bool
	next    time.Time
	backoff time.Duration
}

// monoBase anchors monoNow.
var monoBase = time.Now()

// monoNow returns t as nanoseconds on the monotonic clock since monoBase
// (at least 1, so that 0 can mean never).
func monoNow(t time.Time) int64 { return max(1, int64(t.Sub(monoBase))) }

func newBreakers() *breakers {
	return &breakers{min: DefaultProbeMin, max: DefaultProbeMax, obs: nopObserver{}}
}

// get returns node's breaker, creating it closed.
func (bs *breakers) get(node string) *breaker {
	if b, ok := bs.nodes.Load(node); ok {
		return b.(*breaker)
	}
	b, _ := bs.nodes.LoadOrStore(node, &breaker{node: node})
	return b.(*breaker)
}

// allowB reports whether a call may go to b's node now, and whether it
// goes as the probe of an open breaker. It takes no lock while b is
// closed.
func (bs *breakers) allowB(b *breaker) (ok, probe bool) {
	if !b.open.Load() {
		return true, false
	}
	bs.mu.Lock()
	defer bs.mu.Unlock()
	if !b.open.Load() {
		return true, false
	}
	if b.probing || time.Now().Before(b.next) {
		return false, false
	}
	b.probing = true
	return true, true
}

// state reports whether any node's breaker is open and, if so, how long
// until the soonest next probe of one.
func (bs *breakers) state() (open bool, probeIn time.Duration) {
	bs.mu.Lock()
	defer bs.mu.Unlock()
	bs.nodes.Range(func(_, v any) bool {
		if b := v.(*breaker); b.open.Load() {
			in := bs.probeInLocked(b)
			if !open || in < probeIn {
				probeIn = in
			}
			open = true
		}
		return true
	})
	return open, probeIn
}

// probeInLocked returns how long until the next probe of b, open, may go:
// while a probe is under way, at least the shortest probe interval (the
// soonest the next could follow it, should it fail), never 0, which would
// send a caller told to come back then (FailClosed's retry-after) round
// again at once. Call with bs.mu held.
func (bs *breakers) probeInLocked(b *breaker) time.Duration {
	in := max(0, time.Until(b.next))
	if b.probing {
		in = max(in, bs.min)
	}
	return in
}

// stateOf reports whether node's breaker is open and how long until its
// next probe may go.
func (bs *breakers) stateOf(node string) (open bool, probeIn time.Duration) {
	v, ok := bs.nodes.Load(node)
	if !ok || !v.(*breaker).open.Load() {
		return false, 0
	}
	b := v.(*breaker)
	bs.mu.Lock()
	defer bs.mu.Unlock()
	if !b.open.Load() {
		return false, 0
	}
	return true, bs.probeInLocked(b)
}

// failure records a call to node, sent at start, that failed as if Redis
// were unavailable. If another call to node has succeeded since start, the
// node was up while this one waited: the failure is this client's own (a
// starved goroutine, a lost packet), not Redis's, and the breaker stays
// closed, so a busy client never fails every caller at once (or hands them
// all to the fallback).
func (bs *breakers) failure(node string, start time.Time) { bs.failureB(bs.get(node), start) }

// failureB is failure for a breaker in hand, of a call that was not the
// probe. If the breaker is open already (the call was sent before it
// opened), it changes nothing: neither the next probe's time nor the
// probe under way are the business of a call that was not the probe.
func (bs *breakers) failureB(b *breaker, start time.Time) {
	bs.mu.Lock()
	defer bs.mu.Unlock()
	if !b.open.Load() {
		bs.openLocked(b, start)
	}
}

// probeFailedB records the failure of the probe of b's node, sent at
// start: the next probe waits twice as long as the last (up to the
// maximum). Should the breaker have closed meanwhile (another call
// succeeded), it is a failure as failureB records it.
func (bs *breakers) probeFailedB(b *breaker, start time.Time) {
	bs.mu.Lock()
	defer bs.mu.Unlock()
	if !b.open.Load() {
		bs.openLocked(b, start)
		return
	}
	b.backoff = min(2*b.backoff, bs.max)
	b.probing = false
	b.next = time.Now().Add(b.backoff)
}

// openLocked opens b, closed, after a failure of a call sent at start,
// unless a call to its node has succeeded since start. Call with bs.mu
// held.
func (bs *breakers) openLocked(b *breaker, start time.Time) {
	// Open first, then look for a success since start: a success stores
	// its time before it reads open (successB), so either we see its time
	// here, or it sees the breaker open and closes it.
	b.open.Store(true)
	if b.lastSuccess.Load() > monoNow(start) {
		b.open.Store(false)
		return
	}
	b.backoff = bs.min
	b.probing = false
	b.next = time.Now().Add(b.backoff)
	bs.changed(b.node, true)
}

// success records a call to node that Redis answered.
func (bs *breakers) success(node string) { bs.successB(bs.get(node), time.Now()) }

// successB is success for a breaker in hand, of a call that ended at end:
// no lock unless the breaker is open.
func (bs *breakers) successB(b *breaker, end time.Time) {
	b.lastSuccess.Store(monoNow(end))
	if !b.open.Load() {
		return
	}
	bs.mu.Lock()
	defer bs.mu.Unlock()
	if !b.open.Load() {
		return
	}
	b.open.Store(false)
	b.probing = false
	bs.changed(b.node, false)
}

// abandonB releases the probe of b's node, for a call that was the probe
// and ended without a verdict (the caller's context ended, or the client
// had no connection to send it on).
func (bs *breakers) abandonB(b *breaker) {
	bs.mu.Lock()
	defer bs.mu.Unlock()
	b.probing = false
}

// changed tells the observer that node's breaker opened or closed, and the
// engine-wide ObserveBreaker when the first one opens or the last one
// closes. Call with bs.mu held: the lock orders the notifications.
func (bs *breakers) changed(node string, open bool) {
	if bs.nodeObs != nil {
		bs.nodeObs.ObserveNodeBreaker(node, open)
	}
	if open {
		if bs.nOpen.Add(1) == 1 {
			bs.obs.ObserveBreaker(true)
		}
		return
	}
	if bs.nOpen.Add(-1) == 0 {
		bs.obs.ObserveBreaker(false)
	}
}

// anyOpen reports, without the lock, whether some breaker is open (as
// state would, but for a breaker opening or closing meanwhile).
func (bs *breakers) anyOpen() bool { return bs.nOpen.Load() > 0 }

// retire closes every open breaker whose node stale reports that no call
// maps to any more: a Cluster master whose slots a failover or a
// resharding gave to other nodes. No probe could close such a breaker,
// since no call goes to its node. (The pseudo-node "cluster" is closed as
// any node is, by a success: reading the slot map.) The observer is told
// of each closing, in order, as of any other (see changed). retire returns
// the nodes whose breakers it closed. A call to such a node still under
// way may open its breaker again when it fails; the next retire closes it.
func (bs *breakers) retire(stale func(node string) bool) (retired []string) {
	bs.mu.Lock()
	defer bs.mu.Unlock()
	bs.nodes.Range(func(_, v any) bool {
		b := v.(*breaker)
		if b.open.Load() && stale(b.node) {
			b.open.Store(false)
			b.probing = false
			bs.changed(b.node, false)
			retired = append(retired, b.node)
		}
		return true
	})
	return retired
}

// ErrReplyLost is matched, together with ErrUnavailable (or the context's
// error, when the caller's context ended first), by errors for calls that
// were sent but whose reply never came: a timeout or a broken connection
// after the command was written. The script may have run: a lost booking
// reply may have booked slots nobody will use (quota wasted, never
// exceeded); a lost refund reply may have given the booking back (retrying
// the refund is safe: refunds are idempotent). An error that matches
// ErrUnavailable without ErrReplyLost means nothing reached Redis. A reply
// that came but cannot be read (not what the script answers: a proxy that
// mangled it, say) matches ErrReplyLost alone: the script ran, and Redis is
// not counted as down.
var ErrReplyLost = errors.New("throttle: reply lost, the call may have taken effect")

// ErrCorruptState is matched by errors for a key that holds a value the
// engine did not write: not an integer count of microseconds, beyond 2^53,
// or further ahead than any booking under its limit could reach. The
// message names the key; Engine.Reset (or reserve's Limiter.Reset) clears
// it. Nothing is written over such a value.
var ErrCorruptState = errors.New("throttle: corrupt stored state")

// notSent reports whether err shows that the command never reached Redis
// (or that Redis refused it without running it), so that it certainly took
// no effect: a failed dial, no connection to be had from the client's pool,
// or a server that answered it is loading, down or busy.
func notSent(err error) bool {
	// A failed dial sent nothing; after a failed write the command was not
	// written whole, and go-redis closes the connection: Redis never ran
	// it. (The engine sends one command per call, and never retries one.)
	var op *net.OpError
	if errors.As(err, &op) && (op.Op == "dial" || op.Op == "write") {
		return true
	}
	return errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, redis.ErrPoolTimeout) ||
		errors.Is(err, redis.ErrPoolExhausted) || waitedInClient(err) || handshakeFailed(err) ||
		cannotServe(err) || ringDown(err)
}

// ringDown reports whether err is a Ring's answer that it has no shard up
// (its heartbeat marked every one down): the command was sent nowhere.
// go-redis does not export the error (checked for v9.23: ring.go's
// errRingShardsDown), so its message is matched.
func ringDown(err error) bool { return err.Error() == "redis: all ring shards are down" }

// handshakeFailed reports whether err is the cause go-redis returns when a
// new connection's handshake (HELLO, AUTH, the commands of OnConnect)
// fails on the socket: its initPooledConn unwraps the *net.OpError (checked
// for v9.23), leaving an i/o timeout or a syscall error such as
// ECONNRESET, while a failure of the call's own command keeps its
// *net.OpError. The command was not sent. (A bare io.EOF proves nothing:
// a command's own read returns it bare too.) Such a failure still counts
// against the node, as any unavailable error does: a stopped server fails
// a new connection's HELLO the same way as a handshake that came late.
func handshakeFailed(err error) bool {
	var op *net.OpError
	if errors.As(err, &op) {
		return false
	}
	var se *os.SyscallError
	return errors.Is(err, os.ErrDeadlineExceeded) || errors.As(err, &se)
}

// writeTimedOut reports whether err is a write that timed out: the call
// had its connection only once its time was up (it waited for a turn in
// the pool, or for a new connection's OnConnect), and the socket refused
// to write past the deadline. It says nothing of Redis: a server, up or
// stopped, takes a command's few hundred bytes into the socket's buffer
// at once, so a server that does not answer shows as a read that times
// out, never as a write.
func writeTimedOut(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "write" && op.Timeout()
}

// waitedInClient reports whether err is a context's error as go-redis
// returns it when the context ends before the command was written: while
// the call waits its turn for a pooled connection, for a dial permit or a
// dial under way, for a new connection's setup by another call, or before
// a retry (which the engine's commands get only when nothing was written).
// go-redis returns the bare ctx.Err() there (checked for v9.23: pool.go
// waitTurn and queuedNewConn, the cluster client's redirections), whatever
// ContextTimeoutEnabled says, while a socket timeout after sending is a
// *net.OpError ("i/o timeout").
func waitedInClient(err error) bool {
	var op *net.OpError
	return (errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled)) && !errors.As(err, &op)
}

// saturated reports whether err is the client's own pool having no
// connection for the call in time: the client is busy, which says nothing
// of Redis, so no breaker opens (a saturated client must never turn the
// limit off through FailOpen). poolFull tells whether the node's pool
// holds every connection it may open: a call that waited inside the
// client (waitedInClient) then waited for its turn, behind other work on
// the client; with room in the pool it waited for a new connection, and
// a dial that does not complete in time says the node is unreachable.
//
// A write that timed out (writeTimedOut) is counted here too: the call
// came to its connection late, which is the client's doing.
func saturated(err error, poolFull func() bool) bool {
	return errors.Is(err, redis.ErrPoolTimeout) || errors.Is(err, redis.ErrPoolExhausted) ||
		writeTimedOut(err) || (waitedInClient(err) && poolFull())
}

// unavailable reports whether err means Redis could not be reached or could
// not serve, as opposed to a reply that was an error.
func unavailable(err error) bool {
	var ne net.Error
	switch {
	case errors.Is(err, context.DeadlineExceeded),
		errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF),
		errors.Is(err, syscall.ECONNREFUSED), errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE),
		errors.Is(err, redis.ErrPoolTimeout), errors.Is(err, redis.ErrPoolExhausted),
		errors.As(err, &ne):
		return true
	}
	return cannotServe(err) || ringDown(err)
}

// slotBusy reports whether err is Redis's answer that the key's slot cannot
// serve this call now while the node serves its other slots: TRYAGAIN, a
// call on several keys of a slot being resharded, some of them already
// moved (or never written). Nothing ran. The node is up, so its breaker,
// which would fail every subject of the node, must not open.
func slotBusy(err error) bool { return redis.HasErrorPrefix(err, "TRYAGAIN") }

// cannotServe reports whether err is Redis's answer that it cannot run the
// command now (loading, a master down, a cluster resharding, a script
// running too long) or cannot write (out of memory, a read-only replica
// after a failover, a failed save, too few replicas): nothing was written.
func cannotServe(err error) bool {
	msg := err.Error()
	for _, p := range []string{"LOADING", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "BUSY", "OOM", "READONLY", "MISCONF", "NOREPLICAS"} {
		if strings.HasPrefix(msg, p) {
			return true
		}
	}
	return false
}
