package lease

import (
	"context"
	"crypto/rand"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/slotbook/slotbook/throttle"
)

var (
	//go:embed scripts/common.lua
	commonSrc string
	//go:embed scripts/acquire.lua
	acquireSrc string
	//go:embed scripts/release.lua
	releaseSrc string
	//go:embed scripts/leave.lua
	leaveSrc string
	//go:embed scripts/keep.lua
	keepSrc string

	acquireScript = throttle.NewScript(commonSrc + acquireSrc)
	releaseScript = throttle.NewScript(commonSrc + releaseSrc)
	leaveScript   = throttle.NewScript(commonSrc + leaveSrc)
	keepScript    = throttle.NewScript(commonSrc + keepSrc)
	wakeScript    = throttle.NewScript("redis.call('RPUSH', KEYS[1], '') redis.call('PEXPIRE', KEYS[1], ARGV[1]) return 1")
)

// ErrInvalid is matched by the errors for bad input: a nil engine, an
// empty name, N <= 0, a TTL or poll interval out of range, an empty or
// over-long key. No Redis call is made for such input.
var ErrInvalid = errors.New("lease: invalid argument")

// ErrClosed is returned by Acquire and TryAcquire once the Semaphore is
// closed, also to callers still waiting.
var ErrClosed = errors.New("lease: semaphore closed")

// ErrLost is returned by Release for a lease that had lapsed before it was
// released: it was not extended in time (the process stalled, or Redis was
// unreachable, for longer than the TTL), so another holder may have run
// alongside it. Lease.Lost is closed when the lapse is found, or once it
// may have happened.
var ErrLost = errors.New("lease: lease lapsed before it was released")

// Defaults and bounds for New.
const (
	DefaultTTL = 30 * time.Second
	// MinTTL is the shortest TTL New accepts: the lease is extended every
	// TTL/3, which must leave room for a Redis round trip.
	MinTTL = 30 * time.Millisecond
	// MaxPoll bounds the default fallback poll: while a process has
	// waiters for a key it asks Redis at least this often (and at least
	// every TTL/3) whether one of them was granted a lease whose wake-up
	// it missed.
	MaxPoll = time.Second
)

// maxSubject bounds a key's length so that every engine key built on it
// stays within throttle.MaxKeyLen.
const maxSubject = throttle.MaxKeyLen - 64

// A Semaphore allows at most N leases per key at once, across every process
// that builds one with the same engine prefix and name: a distributed
// counting semaphore whose permits lapse unless their holder keeps them.
//
// A Semaphore is safe for concurrent use. Build one with New and stop it
// with Close; the zero Semaphore is not usable.
type Semaphore struct {
	eng   *throttle.Engine
	name  string
	n     int
	ttl   time.Duration
	poll  time.Duration
	obs   Observer
	proc  string  // this Semaphore's id in Redis: lease ids are proc.n
	blpop blocker // nil: no blocking wait, the poll alone finds grants
	// waker, on a single node, reads the wake-up lists of every key in one
	// blocking read; nil on a Cluster or a Ring, where each room's keeper
	// reads its own.
	waker *waker
	// typed, on a client whose ReadTimeout is short, is its own BLPop
	// (see blpopCall); nil otherwise.
	typed typedBlocker
	quit  chan struct{}

	mu    sync.Mutex       // guards the fields below, and every room and Lease
	rooms map[string]*room // by key: the keys this process holds or waits for
	seq   uint64           // numbers lease ids
	// leaveSeq numbers the rooms' leaving entries (see gone).
	leaveSeq uint64
	closed   bool
	// closers counts the Close calls under way. giveUp is closed, and
	// gaveUp set, once every one has returned with its context's error:
	// the keepers then end, their rooms keeping the leave calls they
	// still owe (see keep); a Close called after makes a new giveUp and
	// starts keepers afresh to send them.
	closers int
	gaveUp  bool
	giveUp  chan struct{}
	// keepers holds the rooms' keepers and the waker, in generations: a
	// Close called after every Close under way gave up starts keepers
	// afresh, in a WaitGroup of their own, for the rooms that still owe
	// leave calls (a WaitGroup whose Wait may still be returning, an
	// earlier Close's, must not be added to). Goroutines join the last;
	// Close waits for them all.
	keepers []*sync.WaitGroup
	// away counts, by Redis node (throttle.Engine.Node), the leave rounds
	// after Close in a row, over the rooms of the node's keys, that found
	// it away: a call was let through and reached no Redis, none reached
	// it, and the node's breaker is open (see sendLeaves). By node: a
	// Cluster master, or a Ring shard, that answers is not away because
	// another is stopped (helper-146, TestReviewAway49HealthyMasterDropped;
	// helper-147, TestReviewAway49bRingShardStopped).
	away map[string]int
}

// blocker is what the wake-up needs of the go-redis clients (Client,
// ClusterClient, Ring): sending a command of its own making. (Their BLPop
// method rounds a timeout under a second up to a second.)
type blocker interface {
	Process(ctx context.Context, cmd redis.Cmder) error
}

// An Option configures a Semaphore in New.
type Option func(*Semaphore) error

// WithTTL sets how long a lease lives unless extended (default DefaultTTL,
// at least MinTTL). Held leases are extended every TTL/3, so a process
// that dies frees its leases within the TTL of its last extension. A
// holder gives its lease up (Lost) when no extension has come back within
// 9/10 of the TTL of the last successful one's sending, and a lease granted
// by another process's call starts from its waiter's last refresh (up to
// a poll interval, and a blocking read's lateness, earlier; on a single
// node, from its refresh before the read, and a lease that would be left
// under a third of the TTL that way waits for a keep call that tells how
// long Redis holds it): keep the TTL well above three round trips plus
// twice the poll interval, or leases are given up while Redis holds them.
func WithTTL(d time.Duration) Option {
	return func(s *Semaphore) error {
		if d < MinTTL {
			return fmt.Errorf("%w: TTL %v (at least %v)", ErrInvalid, d, MinTTL)
		}
		s.ttl = d
		return nil
	}
}

// WithPollInterval sets the fallback poll: how often, while a process has
// waiters for a key, it asks Redis whether they were granted a lease, in
// case a wake-up was lost (default the shorter of TTL/3 and MaxPoll; it
// may not exceed TTL/3, since the same call keeps the waiters in the
// queue).
func WithPollInterval(d time.Duration) Option {
	return func(s *Semaphore) error {
		if d <= 0 {
			return fmt.Errorf("%w: poll interval %v", ErrInvalid, d)
		}
		s.poll = d
		return nil
	}
}

// WithObserver reports the semaphore's work to o (NewCollector returns one
// for Prometheus). A nil o is invalid, and so is a nil pointer (map, func,
// channel, slice) in a non-nil interface, such as a nil *Collector, whose
// methods would panic on the first call.
func WithObserver(o Observer) Option {
	return func(s *Semaphore) error {
		if o == nil {
			return fmt.Errorf("%w: nil observer", ErrInvalid)
		}
		switch rv := reflect.ValueOf(o); rv.Kind() {
		case reflect.Pointer, reflect.Map, reflect.Func, reflect.Chan, reflect.Slice, reflect.Interface, reflect.UnsafePointer:
			if rv.IsNil() {
				return fmt.Errorf("%w: nil observer (a nil %T)", ErrInvalid, o)
			}
		}
		s.obs = o
		return nil
	}
}

// New returns a Semaphore of n leases per key, named name (which
// namespaces its keys in Redis, beside the rate keys of a reserve.Limiter
// of the same name, and labels its metrics). Every process sharing the
// limit must use the same engine prefix, name and n. New makes no network
// call; it returns an error matching ErrInvalid for bad input.
func New(eng *throttle.Engine, name string, n int, opts ...Option) (*Semaphore, error) {
	switch {
	case eng == nil:
		return nil, fmt.Errorf("%w: nil engine", ErrInvalid)
	case name == "" || strings.ContainsAny(name, "{}"):
		return nil, fmt.Errorf("%w: name %q (want a non-empty name without braces)", ErrInvalid, name)
	case n <= 0:
		return nil, fmt.Errorf("%w: n = %d leases (want at least 1)", ErrInvalid, n)
	}
	var id [8]byte
	if _, err := rand.Read(id[:]); err != nil {
		return nil, fmt.Errorf("lease: process id: %w", err)
	}
	s := &Semaphore{
		eng: eng, name: name, n: n, ttl: DefaultTTL, obs: nopObserver{},
		proc: hex.EncodeToString(id[:]), quit: make(chan struct{}), giveUp: make(chan struct{}), rooms: make(map[string]*room),
		keepers: []*sync.WaitGroup{new(sync.WaitGroup)},
	}
	for _, opt := range opts {
		if err := opt(s); err != nil {
			return nil, err
		}
	}
	if s.poll == 0 {
		s.poll = min(s.ttl/3, MaxPoll)
	}
	if s.poll > s.ttl/3 {
		return nil, fmt.Errorf("%w: poll interval %v longer than TTL/3 = %v", ErrInvalid, s.poll, s.ttl/3)
	}
	s.blpop, _ = eng.Client().(blocker)
	if shortReads(eng.Client()) {
		s.typed, _ = eng.Client().(typedBlocker)
	}
	if _, single := eng.Client().(*redis.Client); single {
		s.waker = newWaker(name, s.proc)
	}
	return s, nil
}

// Load sends the semaphore's scripts to Redis, so that the first calls do
// not pay for a NOSCRIPT round trip each. Calling it is optional.
func (s *Semaphore) Load(ctx context.Context) error {
	for _, sc := range []*throttle.Script{acquireScript, releaseScript, leaveScript, keepScript, wakeScript, drainScript} {
		if err := s.eng.LoadScript(ctx, sc); err != nil {
			return fmt.Errorf("lease: load scripts: %w", err)
		}
	}
	return nil
}

// Name returns the semaphore's name.
func (s *Semaphore) Name() string { return s.name }

// N returns the most leases held at once per key.
func (s *Semaphore) N() int { return s.n }

// TTL returns how long a lease lives unless extended.
func (s *Semaphore) TTL() time.Duration { return s.ttl }

// CheckKey reports whether key is acceptable: not empty, not too long, and
// with no braces that would leave its Redis keys without a hash tag. The
// error matches ErrInvalid.
func (s *Semaphore) CheckKey(key string) error {
	if key == "" {
		return fmt.Errorf("%w: empty key", ErrInvalid)
	}
	if len(s.name)+len(key) > maxSubject {
		return fmt.Errorf("%w: key of %d bytes", ErrInvalid, len(key))
	}
	if err := throttle.CheckKey(s.holdersKey(key)); err != nil { // braces that leave no hash tag
		return fmt.Errorf("%w: key %q: %w", ErrInvalid, key, err)
	}
	return nil
}

// keys returns the engine keys (before the engine's prefix) of key:
// "name:{key}:lease:h" and so on, hash-tagged by the subject like the
// rate keys, so that a Redis Cluster holds them on one node.
func (s *Semaphore) keys(key string) []string {
	base := s.keyBase(key)
	return []string{base + "h", base + "t", base + "q", base + "w", base + "c", base + "n:", base + "l"}
}

// keyBase returns what every engine key of key begins with (before the
// engine's prefix).
func (s *Semaphore) keyBase(key string) string { return s.name + ":{" + key + "}:lease:" }

// holdersKey returns keys(key)[0] alone, without building the others:
// the key that names key's node and slot to the engine.
func (s *Semaphore) holdersKey(key string) string { return s.keyBase(key) + "h" }

// A Lease is one of a Semaphore's N places for a key, held until Release
// (or until it lapses: see Lost). Its methods are safe for concurrent use.
type Lease struct {
	sem   *Semaphore
	key   string
	id    string
	token int64
	lost  chan struct{} // closed when the lease is found lapsed, or may have

	// Guarded by sem.mu.
	released bool
	wasLost  bool
	// deadline is when the lease may lapse in Redis, on this process's
	// clock, less a margin (see lostBy): the TTL after the latest call that
	// extended it was sent, or for a grant, the later of the TTL after the
	// latest call that found its waiter not yet granted and, for a grant
	// reported in a reply, the call's sending plus the time left Redis
	// reported. lapse closes lost then, unless an extension has moved it.
	deadline time.Time
	timer    *time.Timer // runs lapse at deadline
	// fresh marks a lease granted with less than 2/3 of the TTL left by
	// its deadline (granted by another process's call while its waiter's
	// latest refresh was a while ago, or reported by a slow call): the
	// keeper extends it at once rather than at its next interval.
	fresh bool
}

// Key returns the key the lease is for.
func (l *Lease) Key() string { return l.key }

// Token returns the lease's fencing token: it is larger than the token of
// every lease granted for the same key (name and prefix) before it, by
// any process. A resource that remembers the largest token it has seen
// can refuse a holder whose lease lapsed while it stalled.
func (l *Lease) Token() int64 { return l.token }

// Lost is closed if the lease is found to have lapsed before it was
// released (an extension came too late), or once it may have: when 9/10
// of the TTL have passed since the last successful extension (or the
// grant) was sent, measured on this process's clock, before Redis lets the
// lease lapse (Redis unreachable, the process stalled, or replies slower
// than the TTL allows: see WithTTL). It is closed, too, when Close gives
// the lease back. The holder should stop, since another may now hold its
// place.
func (l *Lease) Lost() <-chan struct{} { return l.lost }

// Release gives the lease back and wakes the next waiter, in one Redis
// call. It returns ErrLost if the lease had lapsed, and nil if it was
// released before. If the call fails (ctx ended, Redis unreachable), it
// returns the error, the lease is no longer extended, and the Semaphore
// gives it back with a leave call of its own, as it does a gone waiter's:
// at each poll interval until one reaches Redis (Close sends it too), or
// until the TTL has passed and Redis has let the lease lapse. A leave call
// gives back only the lease it names, so one that comes after the release
// has run (its reply lost) does nothing.
func (l *Lease) Release(ctx context.Context) error {
	s := l.sem
	s.mu.Lock()
	if l.released {
		s.mu.Unlock()
		return nil
	}
	l.released = true
	l.timer.Stop()
	wasLost := l.wasLost
	r := s.rooms[l.key]
	if r != nil && r.holds[l.id] == l {
		delete(r.holds, l.id)
		s.obs.ObserveHeld(s.name, -1)
	}
	if r != nil && !wasLost {
		r.out++ // the room stays while the call is out: see released
	}
	s.mu.Unlock()
	if wasLost {
		return ErrLost
	}
	reply, err := s.run(ctx, releaseScript, l.key, l.id)
	s.released(r, l, err)
	if err != nil {
		return fmt.Errorf("lease: release %q: %w", l.key, err)
	}
	if reply.status == 0 {
		s.markLost(l)
		return ErrLost
	}
	return nil
}

// released follows l's release call, which returned err; r is l's room
// (nil if it had none), kept while the call was out (room.out). If the
// call failed, the room owes l's leave call, which its keeper sends as it
// sends a gone waiter's (leave.lua gives back a lease its id holds, as
// release.lua does, and does nothing once it is released): the lease is
// given back once Redis answers, not left to lapse after the TTL
// (TestFailedReleaseGivesBack), and Close gives back every lease held
// when it began, or granted as it did, whichever release failed, the
// holder's, Acquire's handing back a grant, or Close's own (helper-143,
// helper-144).
func (s *Semaphore) released(r *room, l *Lease, err error) {
	if r == nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	r.out--
	if err != nil {
		s.leavingLocked(r, l.id, 0) // wakes the keeper
	} else if r.out == 0 {
		select { // the room may be empty now
		case r.wake <- struct{}{}:
		default:
		}
	}
}

// lostBy returns when a lease that Redis holds until held at least (on
// this process's clock) is given up: a tenth of the TTL before, for the
// lateness of this process's timers and goroutines (a busy machine), so
// that Lost is closed before Redis can give the place to another.
func (s *Semaphore) lostBy(held time.Time) time.Time { return held.Add(-s.ttl / 10) }

// markLost closes l.lost once.
func (s *Semaphore) markLost(l *Lease) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.markLostLocked(l)
}

// markLostLocked is markLost with s.mu held.
func (s *Semaphore) markLostLocked(l *Lease) {
	if !l.wasLost {
		l.wasLost = true
		l.timer.Stop()
		close(l.lost)
	}
}

// lapse runs at l's deadline: unless l was released, found lost, or
// extended meanwhile (then it waits for the new deadline), l may have
// lapsed in Redis (lapseLocked). An extension on its way does not hold it
// off: sent before the deadline, it can only have moved the deadline to
// lostBy its own send time plus the TTL, which has passed too by the time
// the old one has if its reply is late.
func (s *Semaphore) lapse(l *Lease) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if l.released || l.wasLost {
		return
	}
	if d := time.Until(l.deadline); d > 0 {
		l.timer.Reset(d)
		return
	}
	s.lapseLocked(l)
}

// lapseLocked gives up l, which may have lapsed in Redis: it is no longer
// extended, its Lost is closed, and its keeper gives it back in Redis (a
// leave call) in case it still stands. s.mu is held.
func (s *Semaphore) lapseLocked(l *Lease) {
	if r := s.rooms[l.key]; r != nil && r.holds[l.id] == l {
		delete(r.holds, l.id)
		s.obs.ObserveHeld(s.name, -1)
		if !s.closed {
			s.leavingLocked(r, l.id, 0)
		}
	}
	s.markLostLocked(l)
}

// Acquire waits for a lease for key and returns it. Waiters are served
// first come, first served across every process: a waiter joins a queue
// in Redis, and a release hands the lease to the head of the queue and
// wakes its process. If ctx ends first, the waiter leaves the queue (and
// gives back a lease granted meanwhile) and Acquire returns ctx's error.
// A waiter leaves the same way, returning the error, when a poll of its
// key fails with WRONGTYPE (one of the key's keys holds another Redis
// type): that error does not pass by waiting, and a first call that met
// it would have returned it too. Other failed polls are tried again
// while the waiter waits (see the package doc).
//
// Without contention Acquire is one Redis call; a waiter costs one more,
// shared with the other waiters of its process for the key (the blocking
// read of its wake-up list), plus the fallback poll while it waits.
func (s *Semaphore) Acquire(ctx context.Context, key string) (*Lease, error) {
	l, _, err := s.acquire(ctx, key, "wait")
	return l, err
}

// TryAcquire takes a lease for key if one is free and nobody is waiting
// for one, without waiting; ok reports whether it did. A full key is not
// an error: l is nil, ok false and err nil.
func (s *Semaphore) TryAcquire(ctx context.Context, key string) (l *Lease, ok bool, err error) {
	l, ok, err = s.acquire(ctx, key, "try")
	return l, ok, err
}

func (s *Semaphore) acquire(ctx context.Context, key, mode string) (*Lease, bool, error) {
	if err := s.CheckKey(key); err != nil {
		return nil, false, err
	}
	if err := ctx.Err(); err != nil {
		return nil, false, err
	}
	start := time.Now()
	w, err := s.enter(key)
	if err != nil {
		return nil, false, err
	}
	if _, err := s.run(ctx, acquireScript, key, w.id, mode); err != nil {
		s.abandon(key, w, errors.Is(err, throttle.ErrReplyLost))
		err = fmt.Errorf("lease: acquire %q: %w", key, err)
		s.obs.ObserveWait(s.name, time.Since(start), err)
		return nil, false, err
	}
	if mode == "try" {
		select {
		case l := <-w.grant:
			return s.handOut(ctx, l, start)
		default: // not granted: it never joined the queue
			s.abandon(key, w, false)
			return nil, false, nil
		}
	}
	s.queued(key, w)
	select {
	case l := <-w.grant:
		return s.handOut(ctx, l, start)
	case ferr := <-w.fail:
		select {
		case l := <-w.grant: // granted all the same: a lease, not an error
			return s.handOut(ctx, l, start)
		default:
		}
		err = fmt.Errorf("lease: acquire %q: %w", key, ferr)
	case <-ctx.Done():
		err = ctx.Err()
	case <-s.quit:
		err = ErrClosed
	}
	s.abandon(key, w, true)
	s.obs.ObserveWait(s.name, time.Since(start), err)
	return nil, false, err
}

// handOut returns l, granted to an Acquire or TryAcquire that began at
// start, to its caller, unless Close has begun meanwhile (Close releases
// only the leases held when it begins, so one granted as it began is
// released here instead, and the caller gets ErrClosed), or unless l may
// have lapsed already (its grant's reply came later than the TTL allows:
// the caller gets an error matching ErrLost, and the lease is given back).
func (s *Semaphore) handOut(ctx context.Context, l *Lease, start time.Time) (*Lease, bool, error) {
	s.mu.Lock()
	if !l.released && !l.wasLost && !time.Now().Before(l.deadline) {
		s.lapseLocked(l) // its timer may not have run yet
	}
	s.mu.Unlock()
	select {
	case <-s.quit:
		rctx, cancel := s.detach(ctx)
		_ = l.Release(rctx)
		cancel()
		s.obs.ObserveWait(s.name, time.Since(start), ErrClosed)
		return nil, false, ErrClosed
	case <-l.lost:
		_ = l.Release(ctx) // ErrLost: the keeper gives it back
		err := fmt.Errorf("lease: acquire %q: granted, but the grant came back after its TTL had run out: %w", l.key, ErrLost)
		s.obs.ObserveWait(s.name, time.Since(start), err)
		return nil, false, err
	default:
	}
	s.obs.ObserveWait(s.name, time.Since(start), nil)
	return l, true, nil
}

// Close stops the semaphore: waiting Acquire callers get ErrClosed (and
// leave the queue), held leases are released (their Lost is closed, and
// their Release is then a no-op) and no longer extended, and Close waits
// for the goroutines that extend leases and wake waiters, or for ctx to
// end. It returns the errors of its releases; a lease whose release
// fails once Close has begun (Close's, its holder's, or an Acquire's
// handing back a lease granted as Close began) is given back by a leave
// call of its own, sent as a gone waiter's is (below). Close is
// idempotent.
//
// Before it returns, the leave call of every waiter that has gone (given
// up, or ended by Close) is sent: those out when Close begins are waited
// for, and one that fails is sent once more. After Close they go side by
// side, and past the engine's breaker while it is open (one at a time);
// one that reaches no Redis is sent again, until it reaches Redis or its
// waiter's TTL has passed (Redis has then dropped the waiter). Only when
// Redis is away (two rounds in a row reach none of it, a call let by the
// breaker failing, the breaker open after; judged master by master for a
// Cluster, shard by shard for a Ring) are they dropped, and Redis drops
// their waiters within the TTL. ctx bounds the wait: once every Close
// under way has returned with its ctx's error, the keepers end, and the
// calls still owed wait for a Close called after (a retry), which sends
// them as the first would have, judging afresh whether Redis is away;
// without one, Redis drops those waiters within the TTL.
func (s *Semaphore) Close(ctx context.Context) error {
	s.mu.Lock()
	s.closers++ // from the start: a Close given up meanwhile must not give up for this one (helper-135)
	if s.gaveUp {
		// A retry of a Close that gave up: the keepers it ended, keeping
		// what their rooms owe, start afresh and send it, judging afresh
		// whether Redis is away (a judgement made for the Close that gave
		// up would have them drop it unsent, Redis answering: helper-142).
		s.gaveUp, s.giveUp = false, make(chan struct{})
		clear(s.away)
		s.keepers = append(s.keepers, new(sync.WaitGroup))
		for _, r := range s.rooms {
			if !r.keeping {
				s.keepLocked(r)
			}
		}
	}
	if !s.closed {
		s.closed = true
		close(s.quit)
	}
	var held []*Lease
	var blocked []string
	for _, r := range s.rooms {
		for _, l := range r.holds {
			held = append(held, l)
		}
		if r.blocking {
			blocked = append(blocked, s.wakeList(r.key))
		}
	}
	if s.waker != nil && s.waker.lists != nil {
		blocked = append(blocked, s.waker.ctl)
	}
	s.mu.Unlock()
	// The releases and the wake-ups go out side by side: one after
	// another, on a slow link, the last leases could lapse unextended
	// before their release went out, and stand in Redis until their TTL.
	var (
		wg   sync.WaitGroup
		emu  sync.Mutex
		errs []error
	)
	wg.Go(func() { s.pushWakes(ctx, blocked) })
	for _, l := range held {
		wg.Go(func() {
			err := l.Release(ctx)
			if err != nil && !errors.Is(err, ErrLost) {
				emu.Lock()
				errs = append(errs, err)
				emu.Unlock()
			}
			s.markLost(l) // the holder should stop: the lease is given back
		})
	}
	wg.Wait()
	stopped := make(chan struct{})
	s.mu.Lock()
	keepers := slices.Clone(s.keepers)
	s.mu.Unlock()
	go func() {
		for _, wg := range keepers {
			wg.Wait()
		}
		close(stopped)
	}()
	select {
	case <-stopped:
	case <-ctx.Done():
		errs = append(errs, ctx.Err())
	}
	s.mu.Lock()
	s.closers--
	if s.closers == 0 && !s.gaveUp && ctx.Err() != nil {
		// No Close waits any more: the keepers end, rather than run on
		// for up to the TTL, keeping what they owe for a later Close.
		s.gaveUp = true
		close(s.giveUp)
	}
	s.mu.Unlock()
	return errors.Join(errs...)
}

// reply is a lease script's answer.
type reply struct {
	status  int64
	expired int64
	grants  []grant   // to this process's waiters
	extra   []string  // keep: the held leases found lapsed
	sent    time.Time // when the call was sent (before it waited for a connection)
}

// A grant is a lease granted to one of this process's waiters.
type grant struct {
	id    string
	token int64
	// by is a time, on this process's clock, until which Redis holds the
	// lease at least: the sending of the call that reported the grant plus
	// the time Redis said it had left (the call ran after it was sent).
	// Zero for a grant read from a wake-up list, which says nothing of
	// when it was made.
	by time.Time
	// waked marks a wake-up read by the waker, and before is then a time
	// before which it was not granted: its waiter's since when the read
	// was sent, or, zero, its waiter's entered (see wakeLoop).
	waked  bool
	before time.Time
}

// run runs script for key with the common arguments, then id-specific
// ones, hands the grants it reports to their waiters, and reports the
// lapsed leases it swept.
func (s *Semaphore) run(ctx context.Context, script *throttle.Script, key string, args ...any) (reply, error) {
	return s.runCall(ctx, false, script, key, args...)
}

// runCall is run; if past, the engine's open breaker does not refuse the
// call (RunScriptPastBreaker: the leave calls after Close).
func (s *Semaphore) runCall(ctx context.Context, past bool, script *throttle.Script, key string, args ...any) (reply, error) {
	all := append([]any{s.proc, s.n, s.ttl.Microseconds()}, args...)
	sent := time.Now()
	var raw any
	var err error
	if past {
		raw, err = s.eng.RunScriptPastBreaker(ctx, script, s.keys(key), all...)
	} else {
		raw, err = s.eng.RunScript(ctx, script, s.keys(key), all...)
	}
	if err != nil {
		return reply{}, err
	}
	r, err := parse(raw, sent)
	if err != nil {
		return reply{}, fmt.Errorf("lease: %q: %w", key, err)
	}
	r.sent = sent
	if r.expired > 0 {
		s.obs.ObserveExpired(s.name, int(r.expired))
	}
	s.deliver(key, r.grants)
	return r, nil
}

// parse checks a script's reply, {status, expired, {id, token, µs
// left...}, {id...}}, to a call sent at sent.
func parse(raw any, sent time.Time) (reply, error) {
	arr, ok := raw.([]any)
	if !ok || len(arr) != 4 {
		return reply{}, fmt.Errorf("unexpected reply %T %v, want an array of 4", raw, raw)
	}
	var r reply
	if r.status, ok = arr[0].(int64); !ok {
		return reply{}, fmt.Errorf("unexpected status %T", arr[0])
	}
	if r.expired, ok = arr[1].(int64); !ok {
		return reply{}, fmt.Errorf("unexpected expired count %T", arr[1])
	}
	gs, ok := arr[2].([]any)
	if !ok || len(gs)%3 != 0 {
		return reply{}, fmt.Errorf("unexpected grants %T %v", arr[2], arr[2])
	}
	for i := 0; i < len(gs); i += 3 {
		id, ok1 := gs[i].(string)
		token, ok2 := gs[i+1].(int64)
		left, ok3 := gs[i+2].(int64)
		if !ok1 || !ok2 || !ok3 {
			return reply{}, fmt.Errorf("unexpected grant %T %T %T", gs[i], gs[i+1], gs[i+2])
		}
		r.grants = append(r.grants, grant{id: id, token: token, by: sent.Add(time.Duration(left) * time.Microsecond)})
	}
	ex, ok := arr[3].([]any)
	if !ok {
		return reply{}, fmt.Errorf("unexpected lost list %T", arr[3])
	}
	for _, v := range ex {
		id, ok := v.(string)
		if !ok {
			return reply{}, fmt.Errorf("unexpected lost id %T", v)
		}
		r.extra = append(r.extra, id)
	}
	return r, nil
}

// parseWake parses a wake-up list entry, "id token".
func parseWake(v string) (grant, bool) {
	id, tok, ok := strings.Cut(v, " ")
	if !ok {
		return grant{}, false
	}
	token, err := strconv.ParseInt(tok, 10, 64)
	if err != nil {
		return grant{}, false
	}
	return grant{id: id, token: token}, true
}

// detach returns a context for a call that must go out although the
// caller's context has ended (a waiter leaving the queue): the caller's
// values, and a bound of its own.
func (s *Semaphore) detach(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), max(time.Second, 4*s.eng.Timeout()))
}
