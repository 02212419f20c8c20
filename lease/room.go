package lease

import (
	"context"
	"errors"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
	"golang.org/x/sync/errgroup"

	"github.com/slotbook/slotbook/internal/rediserr"
	"github.com/slotbook/slotbook/throttle"
)

// A room is what one Semaphore holds and waits for on one key. It exists,
// in Semaphore.rooms, while it has a holder or a waiter, and its keeper
// goroutine runs while it exists. Every field is guarded by the
// Semaphore's mu.
type room struct {
	key     string
	waiters map[string]*waiter // by id: Acquire callers whose lease is not yet granted
	holds   map[string]*Lease  // by id: leases held, extended by the keeper
	wake    chan struct{}      // cap 1: a waiter arrived (the keeper starts blocking for wake-ups)
	// blocking is set while the keeper blocks on the wake-up list (up to
	// the poll interval): Close pushes an empty wake-up to end it.
	blocking bool
	// leaving holds, by id, the waiters that are gone but may still stand
	// in Redis (a leave call that failed, or a keep call that may have put
	// one back in the queue); the keeper sends their leave calls
	// (sendLeaves).
	leaving map[string]gone
	// check asks the keeper for a keep call at once: the waker read a
	// wake-up too old to time its lease by (see deliver), and the keep
	// call reports the grant with the time Redis has left on it.
	check bool
	// out counts the leave calls out that gone waiters send themselves
	// (abandon's), and the release calls out (Release's): the room, and
	// so its keeper, which Close waits for, stays while they are, to send
	// again those that fail (a release, once Close has begun: see
	// released).
	out int
	// keeping is set while its keeper runs: it ends once every Close
	// under way has given up, and the room stays with what it owes, for
	// a later Close to start a keeper afresh.
	keeping bool
}

// A gone waiter is one that may still stand in Redis, for its leave call.
type gone struct {
	until time.Time // when Redis has dropped it, and any lease granted to it, anyway
	// spare is the fencing token of a lease granted to the waiter that its
	// holder has released (0: none): the leave call leaves that lease to
	// the release call, which it may overtake, and gives back only a later
	// grant (one a keep call that reached Redis after the release made,
	// having put the waiter back in the queue).
	spare int64
	seq   uint64 // tells this entry from one that replaced it while its call was out
}

// A waiter is one Acquire call. A grant moves it from its room's waiters to
// its holds and sends the Lease on grant; giving up (abandon) takes it out
// of waiters; each happens once, under the Semaphore's mu, whichever is
// first.
type waiter struct {
	id     string
	grant  chan *Lease // cap 1
	fail   chan error  // cap 1: a keep call's lasting error (see lasting), which its Acquire returns
	queued bool        // its acquire call has answered and it waits in the queue
	lease  *Lease      // set when deliver hands it one
	// since is when the latest call that found it not yet granted (or its
	// acquire call, which put it in the queue) was sent: a lease granted
	// to it cannot have been granted, in Redis, before then. (The wake-up
	// of an earlier grant that lapsed unread cannot be read after such a
	// call: the sweep that drops the lapsed lease, which runs before the
	// call finds the waiter not granted, takes its wake-up off the list.)
	// The waker's reads run beside the keeper's calls: see wakeLoop.
	since   time.Time
	entered time.Time // since's first value: when Acquire began
}

// enter registers a new waiter for key, creating the key's room (and
// starting its keeper) if it has none.
func (s *Semaphore) enter(key string) (*waiter, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, ErrClosed
	}
	r := s.roomLocked(key)
	s.seq++
	now := time.Now()
	w := &waiter{id: s.proc + "." + strconv.FormatUint(s.seq, 36), grant: make(chan *Lease, 1), fail: make(chan error, 1),
		since: now, entered: now}
	r.waiters[w.id] = w
	s.obs.ObserveWaiting(s.name, 1)
	return w, nil
}

// roomLocked returns key's room, creating it and starting its keeper if it
// has none. s.mu is held, and s is not closed.
func (s *Semaphore) roomLocked(key string) *room {
	r := s.rooms[key]
	if r == nil {
		r = &room{key: key, waiters: make(map[string]*waiter), holds: make(map[string]*Lease),
			wake: make(chan struct{}, 1), leaving: make(map[string]gone)}
		s.rooms[key] = r
		s.keepLocked(r)
	}
	return r
}

// keepLocked starts r's keeper, one of the current keepers. s.mu is held.
func (s *Semaphore) keepLocked(r *room) {
	r.keeping = true
	s.goLocked(func() { s.keep(r) })
}

// goLocked runs f as one of the current keepers (see Semaphore.keepers).
// s.mu is held.
func (s *Semaphore) goLocked(f func()) {
	wg := s.keepers[len(s.keepers)-1]
	wg.Add(1)
	go func() {
		defer wg.Done()
		f()
	}()
}

// queued records that w's acquire call has answered without granting it a
// lease: it waits in the queue, and its room's keeper starts blocking for
// wake-ups and polling.
func (s *Semaphore) queued(key string, w *waiter) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.rooms[key]
	if r == nil || r.waiters[w.id] != w {
		return // granted already
	}
	w.queued = true
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// waitingLocked reports whether r has a waiter in the queue. s.mu is held.
func (r *room) waitingLocked() bool {
	for _, w := range r.waiters {
		if w.queued {
			return true
		}
	}
	return false
}

// deliver hands each grant to its waiter, if it is still waiting; a grant
// for a waiter that has given up is left to that waiter's leave call,
// which gives it back.
func (s *Semaphore) deliver(key string, gs []grant) {
	if len(gs) == 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.rooms[key]
	if r == nil {
		return
	}
	for _, g := range gs {
		w := r.waiters[g.id]
		if w == nil {
			continue // given up, or delivered already
		}
		// Granted after w.since, so held until w.since plus the TTL at
		// least; a grant reported with its time left may be held longer.
		after := w.since
		if g.waked {
			after = w.entered
			if !g.before.IsZero() {
				after = g.before
			}
		}
		held := after.Add(s.ttl)
		if g.by.After(held) {
			held = g.by
		}
		if g.waked && time.Until(s.lostBy(held)) < s.ttl/3 {
			// All a wake-up of the waker's tells of its grant's time is
			// that it came after its waiter's since when the read was
			// made, which may be long before: the keep call asked for
			// here reports the time Redis has left on it (and whether it
			// has lapsed) instead, so that the lease is not given up
			// while Redis holds it.
			r.check = true
			select {
			case r.wake <- struct{}{}:
			default:
			}
			continue
		}
		delete(r.waiters, g.id)
		l := &Lease{sem: s, key: key, id: g.id, token: g.token, lost: make(chan struct{}), deadline: s.lostBy(held)}
		l.timer = time.AfterFunc(time.Until(l.deadline), func() { s.lapse(l) })
		l.fresh = time.Until(l.deadline) < 2*s.ttl/3
		if l.fresh {
			select { // extend it at once (unless the keeper is in a blocking read)
			case r.wake <- struct{}{}:
			default:
			}
		}
		r.holds[g.id] = l
		w.lease = l
		s.obs.ObserveWaiting(s.name, -1)
		s.obs.ObserveHeld(s.name, 1)
		w.grant <- l // cap 1, sent once
	}
}

// abandon takes w out of its room: a caller that gives up, or a TryAcquire
// that found no room. If leave, it then tells Redis, so that w leaves the
// queue and a lease granted to it meanwhile is given back. While the call
// is out it keeps the room (room.out): Close waits for it, and if it
// fails (Redis unreachable, the engine's breaker open, a lost reply) the
// room's keeper sends it again every poll interval until it succeeds or
// the TTL has passed (by then Redis has dropped the waiter, unrefreshed,
// and any lease granted to it, unextended), and after Close once more
// (see sendLeaves): helper-137.
func (s *Semaphore) abandon(key string, w *waiter, leave bool) {
	s.mu.Lock()
	r := s.rooms[key] // nil only if w's lease was granted and then found lapsed
	if r != nil && r.waiters[w.id] == w {
		delete(r.waiters, w.id)
		s.obs.ObserveWaiting(s.name, -1)
	} else {
		// Granted as it gave up: the lease is on w.grant (and in holds,
		// unless the keeper has found it lapsed).
		l := <-w.grant
		l.released = true
		l.timer.Stop()
		if r != nil && r.holds[l.id] == l {
			delete(r.holds, l.id)
			s.obs.ObserveHeld(s.name, -1)
		}
		leave = true
	}
	if !leave {
		s.mu.Unlock()
		return
	}
	if r == nil && !s.closed {
		r = s.roomLocked(key)
	}
	// After Close, a room its lease found lapsed has left gets no keeper:
	// the call goes alone, and is not sent again.
	var issued uint64 // s.leaveSeq as the call went
	if r != nil {
		r.out++
		issued = s.leaveSeq
	}
	s.mu.Unlock()
	ctx, cancel := s.detach(context.Background())
	_, err := s.run(ctx, leaveScript, key, w.id)
	cancel()
	if r == nil {
		return
	}
	s.mu.Lock()
	r.out--
	if g, ok := r.leaving[w.id]; err != nil && (!ok || g.seq <= issued || g.spare != 0) {
		// Sent again by the keeper; unless an entry asked for since
		// this call went, without a token, is to go or out: its call,
		// later than this one, does what this one was to do.
		s.leavingLocked(r, w.id, 0) // wakes the keeper
	} else if r.out == 0 {
		select { // the room may be empty now
		case r.wake <- struct{}{}:
		default:
		}
	}
	s.mu.Unlock()
}

// leavingLocked adds id to r's leaving, to leave the lease with token
// spare to its release (0: none; a leave asked for without one wins), and
// wakes r's keeper. s.mu is held.
func (s *Semaphore) leavingLocked(r *room, id string, spare int64) {
	if g, ok := r.leaving[id]; ok && g.spare == 0 {
		spare = 0
	}
	s.leaveSeq++
	r.leaving[id] = gone{until: time.Now().Add(s.ttl), spare: spare, seq: s.leaveSeq}
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// sendLeaves sends the leave call of each of r's gone waiters, dropping
// those it succeeds for and those past their time. Before Close they go
// one by one; a round under way when Close begins stops there, and the
// rest go in the closed round (else Close would wait for them one round
// trip each: 0.9 s for 18 at 40 ms each way, helper-137).
//
// After Close, each is tried until its call reaches Redis (an entry asked
// for again while its call was out, once more), side by side, and past
// the engine's open breaker (RunScriptPastBreaker: one such call at a
// time): one by one, or only through the breaker, a call whose reply was
// lost would have the others refused unsent (helper-123, helper-137), and
// so would another caller's probe (helper-134), leaving their waiters in
// the queue for a TTL. A call that reached no Redis (refused by the
// breaker, a refused dial, no connection in time) does not count as
// tried: again reports that some are owed, and the keeper sends them
// again a moment on. A round none of whose calls reached Redis, one of
// them let by the breaker and the breaker open after, says Redis is away
// (the room's node: throttle.Engine.Node, a Cluster's master or a Ring's
// shard); after two such rounds in a row over the rooms of the node's
// keys, with no call reaching the node between them, the calls owed to it
// are dropped (each room's at its next round, unsent): their waiters leave
// Redis's queue within the TTL, unrefreshed. Another node's rooms go on
// sending (helper-146, helper-147: a master or shard that answers is not
// away because another is stopped). Once every Close under way has given
// up (its ctx ended: giveUp), the keeper ends and the calls owed wait for
// a later Close (see keep).
func (s *Semaphore) sendLeaves(r *room) (again bool) {
	// The node of the room's key: Redis is judged away node by node (see
	// below), for a Cluster's masters and a Ring's shards answer or not
	// one by one.
	node := s.eng.Node(context.Background(), s.holdersKey(r.key))
	s.mu.Lock()
	closed := s.closed
	// The room's node judged away (see below): what is owed is dropped
	// unsent. Each keeper's round sending one more call past the breaker
	// to a stopped Redis would fail the client's dials one after another,
	// and trip go-redis's dial lockout (CI, stop 47:
	// TestReviewClose47cStoppedManyKeys).
	away := closed && s.away[node] >= 2
	ids := make([]string, 0, len(r.leaving))
	sent := make([]gone, 0, len(r.leaving))
	for id, g := range r.leaving {
		if away || time.Now().After(g.until) {
			delete(r.leaving, id)
		} else {
			ids = append(ids, id)
			sent = append(sent, g)
		}
	}
	s.mu.Unlock()
	if len(ids) == 0 {
		return false
	}
	// Guarded by s.mu: a call reached Redis; one reached none, and is
	// owed again; one the breaker let by reached none.
	var reached, refused, through bool
	issued := make([]uint64, len(ids)) // s.leaveSeq as each call went
	send := func(i int) {
		s.mu.Lock()
		issued[i] = s.leaveSeq
		s.mu.Unlock()
		ctx, cancel := s.detach(context.Background())
		// After Close, past an open breaker: one lost reply must not have
		// the others refused unsent, nor another caller's probe hold
		// them back (helper-123, helper-137, helper-134).
		_, err := s.runCall(ctx, closed, leaveScript, r.key, ids[i], sent[i].spare)
		cancel()
		unsent := notSent(err)
		s.mu.Lock()
		reached = reached || !unsent
		through = through || unsent && !errors.Is(err, throttle.ErrBreakerOpen)
		// An entry that replaced this one while the call was out (a
		// leave asked for again, perhaps without the spare token: see
		// leavingLocked) is sent at the next round, after Close too
		// (helper-122, helper-123); one that replaced it before the call
		// went is the call's (see covers). A failed call counts as tried
		// only in a round that began after Close (one that failed
		// before, its reply coming after Close began, is tried again:
		// helper-124), and only if it reached Redis.
		if g, ok := r.leaving[ids[i]]; ok && covers(g, sent[i], issued[i]) {
			switch {
			case err == nil || closed && !unsent:
				delete(r.leaving, ids[i])
			case closed:
				refused = true
			}
		}
		s.mu.Unlock()
	}
	if !closed || len(ids) < 2 {
		for i := range ids {
			if !closed && i > 0 && s.isClosed() {
				break // the rest go side by side, at the keeper's next round
			}
			send(i)
		}
	} else {
		var g errgroup.Group
		g.SetLimit(maxCloseLeaves)
		for i := range ids {
			g.Go(func() error { send(i); return nil })
		}
		_ = g.Wait() // send reports nothing: a failed call stays in r.leaving, or counts as tried
	}
	if !closed {
		return false
	}
	// A round none of whose calls reached Redis says it is away if one
	// was let by the breaker (the others it refused say nothing: another
	// call was out past it, or the probe: helper-134) and the breaker is
	// open after it; a client too busy to send them (no connection in
	// time) leaves it closed.
	open := false
	if through && !reached {
		open, _ = s.eng.UnavailableFor(context.Background(), s.holdersKey(r.key))
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case reached:
		delete(s.away, node)
	case open:
		if s.away == nil {
			s.away = make(map[string]int)
		}
		s.away[node]++
	}
	if !refused || s.away[node] < 2 {
		return refused // what is owed waits for the next round, or for a later Close if this one gave up
	}
	for i, id := range ids { // the room's node away twice in a row
		if g, ok := r.leaving[id]; ok && covers(g, sent[i], issued[i]) {
			delete(r.leaving, id)
		}
	}
	return false
}

// covers reports whether a leave call sent for entry sent, when entries up
// to number issued had been asked for, stands for g, the id's entry now:
// g is sent, or replaced it before the call went (asked for again by a
// keep reply, or by abandon's failed call, while sent waited in its
// round), and the call spares no lease g does not. The call, which ran
// after whatever asked for g, then does all g asks: sending g too would
// be a second leave of the same waiter (Close45ManyKeys saw 9 to 26 of
// 500 waiters left twice on a busy machine).
func covers(g, sent gone, issued uint64) bool {
	return g.seq == sent.seq || g.seq <= issued && (sent.spare == 0 || sent.spare == g.spare)
}

// isClosed reports whether Close has begun.
func (s *Semaphore) isClosed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}

// notSent reports whether a lease call's err shows it never reached Redis:
// refused by the engine's open breaker, no connection to be had, a server
// that cannot serve (see throttle.ErrUnavailable), or its bound (detach)
// ended before it was written, waiting for a connection (a bare context
// error: helper-135); a lost reply may have run.
func notSent(err error) bool {
	return (errors.Is(err, throttle.ErrUnavailable) || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled)) &&
		!errors.Is(err, throttle.ErrReplyLost)
}

// maxCloseLeaves is the most leave calls of one key sendLeaves has out at
// once after Close.
const maxCloseLeaves = 16

// keep is a room's keeper: while the room exists it extends its leases
// every TTL/3 and, while it has waiters, blocks on the process's wake-up
// list for the key, running the keep call (which also refreshes the
// waiters and finds grants whose wake-up was lost) every poll interval.
func (s *Semaphore) keep(r *room) {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	last := time.Now()
	// retry is the wait after a keep call that failed, before the next
	// (see retryAfter); 0 after one that succeeded.
	var retry time.Duration
	wakeList := s.eng.Prefix() + s.wakeList(r.key)
	for {
		s.mu.Lock()
		if len(r.waiters) == 0 && len(r.holds) == 0 && len(r.leaving) == 0 && r.out == 0 {
			delete(s.rooms, r.key)
			s.mu.Unlock()
			return
		}
		if s.gaveUp {
			// Every Close under way has given up: end, rather than
			// run on for up to the TTL, keeping what the room owes for
			// a Close called after (a retry), which starts a keeper
			// afresh and sends it.
			r.keeping = false
			s.mu.Unlock()
			return
		}
		fresh := r.check
		r.check = false
		for _, l := range r.holds {
			fresh = fresh || l.fresh
		}
		waiting := r.waitingLocked()
		r.blocking = waiting && s.blpop != nil && s.waker == nil && !s.closed && !fresh
		block := r.blocking
		leaving, closed := len(r.leaving) > 0, s.closed
		kick := waiting && s.waker != nil && !closed && s.wakerNeedLocked(r)
		s.mu.Unlock()

		if kick {
			s.kick()
		}
		if leaving && closed {
			if s.sendLeaves(r) {
				// Some reached no Redis: again a moment on, unless
				// Close gives up.
				s.mu.Lock()
				giveUp := s.giveUp
				s.mu.Unlock()
				t := time.NewTimer(throttle.DefaultProbeMin)
				select {
				case <-t.C:
				case <-giveUp:
					t.Stop()
				}
			}
			continue
		}
		interval := s.ttl / 3
		if waiting || leaving {
			interval = s.poll
		}
		if fresh && !closed {
			last, retry = s.keepOnce(r, retry, interval)
			continue
		}
		due := last.Add(interval)
		if retry > 0 {
			due = last.Add(min(retry, interval))
		}
		until := time.Until(due)
		if until <= 0 {
			last, retry = s.keepOnce(r, retry, interval)
			continue
		}
		if block {
			blocked := s.block(wakeList, r.key, until)
			s.mu.Lock()
			r.blocking = false
			s.mu.Unlock()
			if blocked {
				continue
			}
			// No connection to spare for it: poll alone this interval.
		}
		timer.Reset(until)
		select {
		case <-timer.C:
		case <-r.wake:
			if !timer.Stop() {
				<-timer.C
			}
		case <-s.quit:
			if !timer.Stop() {
				<-timer.C
			}
			// Close releases the holds and the waiters leave: wait for
			// the room to empty, briefly, rather than spinning.
			select {
			case <-time.After(10 * time.Millisecond):
			case <-r.wake:
			}
		}
	}
}

// pushWakes ends the blocking reads of lists (engine keys) with an empty
// wake-up each: the keepers' at Close, the waker's at Close or when a key
// it does not read begins waiting.
func (s *Semaphore) pushWakes(ctx context.Context, lists []string) {
	for _, list := range lists {
		ctx, cancel := s.detach(ctx)
		_, _ = s.eng.RunScript(ctx, wakeScript, []string{list}, s.ttl.Milliseconds()+1000)
		cancel()
	}
}

// maxBlock bounds one blocking read of the wake-up lists: well inside the
// go-redis clients' default ReadTimeout (5 s), which bounds it too.
const maxBlock = time.Second

// shortReads reports whether client c's ReadTimeout is shorter than two
// blocking reads: then its reads go through the client's own BLPop (see
// blpopCall).
func shortReads(c any) bool {
	var rt time.Duration
	switch c := c.(type) {
	case *redis.Client:
		rt = c.Options().ReadTimeout
	case *redis.ClusterClient:
		rt = c.Options().ReadTimeout
	case *redis.Ring:
		rt = c.Options().ReadTimeout
	}
	return rt > 0 && rt < 2*maxBlock
}

// typedBlocker is the go-redis clients' own BLPop.
type typedBlocker interface {
	BLPop(ctx context.Context, timeout time.Duration, keys ...string) *redis.StringSliceCmd
}

// readContext bounds a blocking read of d (see blpopCall), with room for
// its reply (a second and four engine timeouts); the client's own BLPop
// blocks a second for a shorter d.
func (s *Semaphore) readContext(d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), max(d, time.Second)+time.Second+4*s.eng.Timeout())
}

// blpopCall sends one blocking read of lists (with the engine's prefix)
// for d. A read the client gives up on before Redis answers it costs its
// connection (go-redis closes it, and may send the read again first), and
// leaves the wake-ups waiting; and Redis times blocked reads out only
// every 100 ms or so. So on a client whose ReadTimeout is short, the read
// goes through the client's own BLPop, which go-redis lets read for its
// timeout and 10 s more whatever the ReadTimeout, and which rounds a
// timeout under a second up to a second; elsewhere it is sent as it is,
// for d to the millisecond.
func (s *Semaphore) blpopCall(ctx context.Context, d time.Duration, lists []string) *redis.StringSliceCmd {
	if s.typed != nil {
		return s.typed.BLPop(ctx, d, lists...)
	}
	args := make([]any, 0, len(lists)+2)
	args = append(args, "blpop")
	for _, l := range lists {
		args = append(args, l)
	}
	args = append(args, strconv.FormatFloat(d.Seconds(), 'f', 3, 64))
	cmd := redis.NewStringSliceCmd(ctx, args...)
	_ = s.blpop.Process(ctx, cmd)
	return cmd
}

// block waits up to d (at most maxBlock) for a wake-up on list and
// delivers it. It returns false, at once, if the engine has no connection
// to spare for a blocking read (see throttle.Engine.HoldConn: they may
// hold half the client's pool), so that they never starve the calls that
// grant and extend leases; the keeper then finds grants by polling.
func (s *Semaphore) block(list, key string, d time.Duration) bool {
	d = min(max(d, 10*time.Millisecond), maxBlock) // BLPOP's 0 is forever
	ctx, cancel := s.readContext(d)
	defer cancel()
	release, ok := s.eng.HoldConn(ctx, s.wakeList(key))
	if !ok {
		return false
	}
	cmd := s.blpopCall(ctx, d, []string{list})
	release()
	vals, err := cmd.Result()
	switch {
	case errors.Is(err, redis.Nil): // timed out: the poll comes next
	case err != nil:
		// Redis unreachable: wait out the interval rather than spin; the
		// keep call reports it.
		select {
		case <-time.After(d):
		case <-s.quit:
		}
	case len(vals) == 2:
		if g, ok := parseWake(vals[1]); ok {
			s.deliver(key, []grant{g})
		}
	}
	return true
}

// keepOnce runs r's keep call and returns when the next one is due
// from, and the wait after it (0: the interval): from the call's start if
// it succeeded; if it failed, from its end (so that a call that took long,
// its reply lost to a timeout, is not sent again at once), after
// retryAfter's wait.
func (s *Semaphore) keepOnce(r *room, prev, interval time.Duration) (time.Time, time.Duration) {
	start := time.Now()
	err := s.keepCall(r)
	if err == nil {
		return start, 0
	}
	return time.Now(), s.retryAfter(r.key, err, prev, interval)
}

// retryAfter returns how long r's keeper waits, after a keep call for key
// that failed with err, before the next: prev (the wait after the
// failure before, or 0) doubled, at least a base, at most interval. One
// lost reply opens the engine's breaker, which then lets one call through
// as its probe and refuses the others at once: the keepers whose polls
// came due while the probe was out would otherwise find their waiters'
// grants (and extend their leases) a whole interval late, though the
// probe closed the breaker a moment after. So a call that reached no
// Redis (refused by the open breaker, a refused dial, no connection free)
// is tried again from the breaker's next probe, at least
// throttle.DefaultProbeMin on; while Redis stays away that is a few more
// calls per outage, which the open breaker refuses without a round trip.
// A call that reached Redis (its reply lost, or an error Redis answered)
// says Redis is slow or refuses it: it is tried again a quarter interval
// on, so that a struggling Redis gets few more calls than one an
// interval, while a lease whose extension failed is still extended well
// within its TTL.
func (s *Semaphore) retryAfter(key string, err error, prev, interval time.Duration) time.Duration {
	base := throttle.DefaultProbeMin
	if errors.Is(err, throttle.ErrReplyLost) || !errors.Is(err, throttle.ErrUnavailable) {
		base = interval / 4
	}
	d := max(2*prev, base)
	if open, in := s.eng.UnavailableFor(context.Background(), s.holdersKey(key)); open {
		d = max(d, in)
	}
	return min(d, interval)
}

// lasting reports whether a keep call's error will not pass by trying
// again: one of the key's keys holds another Redis type than the lease's
// (WRONGTYPE), which only deleting it mends. A waiter in the queue is
// told of such an error rather than left to wait out its context, as an
// Acquire that met it in its first call is. Other errors Redis answered
// may pass (LOADING, BUSY, a failover's READONLY) or are not the key's
// (NOPERM): the keeper tries them again, and the waiter waits on.
func lasting(err error) bool {
	return rediserr.WrongType(err)
}

// keepCall extends r's leases and refreshes its waiters in one call,
// delivering grants and closing Lost for the leases that lapsed; then it
// sends the leave calls of the gone waiters. It returns the call's error
// (nil if there was nothing to send).
//
// A waiter that leaves while the keep call is on its way (its leave call
// may reach Redis first) is put back in the queue by it, and may be
// granted a lease nobody holds: its leave call is sent again after the
// keep call. So is that of one granted and released while the call was
// out, sparing the lease released (see gone.spare); one granted and still
// held needs none.
func (s *Semaphore) keepCall(r *room) error {
	defer s.sendLeaves(r)
	s.mu.Lock()
	h := len(r.holds)
	args := []any{h}
	for id, l := range r.holds {
		args = append(args, id)
		l.fresh = false
	}
	var ws []*waiter // the waiters refreshed, in args' order
	for id, w := range r.waiters {
		if w.queued {
			args = append(args, id)
			ws = append(ws, w)
		}
	}
	s.mu.Unlock()
	if len(args) == 1 {
		return nil
	}
	ctx, cancel := s.detach(context.Background())
	defer cancel()
	rep, err := s.run(ctx, keepScript, r.key, args...)
	s.mu.Lock()
	for _, w := range ws {
		switch {
		case r.waiters[w.id] == w:
			if err == nil {
				w.since = rep.sent // not granted when the call ran
			} else if lasting(err) {
				select {
				case w.fail <- err: // its Acquire gives up and leaves
				default:
				}
			}
		case w.lease == nil || !w.lease.released && r.holds[w.id] == nil:
			// Gone while the call was out (also after Close: see sendLeaves),
			// or granted and found lapsed meanwhile: lapseLocked's own
			// leave call may have been sent, or dropped, before this call
			// reached Redis and put the waiter back in the queue
			// (helper-122).
			s.leavingLocked(r, w.id, 0)
		case w.lease.released:
			// Granted and released while the call was out: if the call
			// reached Redis after the release, it put the waiter back in
			// the queue, and may have granted it a lease nobody holds.
			// The leave call gives that back, but not the lease
			// released, whose release call it may overtake (helper-121:
			// the Release then found its lease given back, ErrLost).
			// One granted and still held needs none: the call found it
			// held.
			s.leavingLocked(r, w.id, w.lease.token)
		}
	}
	lapsed := make(map[string]bool, len(rep.extra))
	for _, id := range rep.extra {
		lapsed[id] = true
	}
	for _, id := range args[1 : 1+h] {
		l := r.holds[id.(string)]
		if l == nil {
			continue
		}
		if err == nil && !lapsed[l.id] && !l.released && !l.wasLost {
			l.deadline = s.lostBy(rep.sent.Add(s.ttl)) // extended when the call ran; lapse re-arms for it
		}
	}
	s.mu.Unlock()
	if err != nil {
		return err // tried again soon (see retryAfter); the TTL allows two misses
	}
	for _, id := range rep.extra {
		s.mu.Lock()
		l := r.holds[id]
		if l != nil {
			delete(r.holds, id)
			s.obs.ObserveHeld(s.name, -1)
		}
		s.mu.Unlock()
		if l != nil {
			s.markLost(l)
		}
	}
	return nil
}
