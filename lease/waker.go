package lease

import (
	"context"
	"errors"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/slotbook/slotbook/throttle"
)

// A waker is a Semaphore's one blocking read of the wake-up lists of every
// key it has waiters for, on a single Redis node (a redis.Client), where
// one BLPOP can name them all: one connection per process, however many
// keys it waits on. (On a Cluster or a Ring the lists of two keys may live
// on two nodes, and each room's keeper blocks on its own list.) Every field
// is guarded by the Semaphore's mu.
type waker struct {
	running bool // its goroutine runs; it ends when no room waits
	// lists, while a read is being made (from choosing its lists until its
	// reply is read), holds its lists (engine keys, without the engine's
	// prefix) and the key of each; nil otherwise.
	lists  map[string]string
	kicked bool          // a kick was sent for the read being made
	poke   chan struct{} // cap 1: a room waits, for a waker between two reads
	ctl    string        // its own list (engine key), on which kicks end a read
	max    int           // maxWakeLists (less in tests)
}

// maxWakeLists bounds the lists one read names, and so what each read
// costs Redis (a lookup per list, and its name sent). A process waiting
// on more keys at once has its reads name a random choice of them each
// time; the others' wake-ups wait in their lists for a read that names
// them, and their keepers' polls find their grants meanwhile.
const maxWakeLists = 512

// newWaker returns the waker of a Semaphore whose process id is proc.
func newWaker(name, proc string) *waker {
	// The subject keys all hold a "{": this one cannot be one of them.
	return &waker{poke: make(chan struct{}, 1), ctl: name + ":lease:wake:" + proc, max: maxWakeLists}
}

// wakerNeedLocked is called by r's keeper while r has waiters in the
// queue: it starts the waker if none runs, and reports whether the read
// being made leaves r's list out, so that the keeper kicks it (one call)
// to make a read that names it. s.mu is held, and s is not closed.
func (s *Semaphore) wakerNeedLocked(r *room) (kick bool) {
	m := s.waker
	switch {
	case !m.running:
		m.running = true
		s.goLocked(s.wakeLoop)
	case m.lists == nil:
		select { // between two reads: the next one names r's list
		case m.poke <- struct{}{}:
		default:
		}
	case !m.kicked && len(m.lists) < m.max:
		if _, ok := m.lists[s.wakeList(r.key)]; !ok {
			m.kicked = true
			return true
		}
	}
	return false
}

// wakeList returns the engine key of the process's wake-up list for key.
func (s *Semaphore) wakeList(key string) string { return s.keyBase(key) + "n:" + s.proc }

// wakeLoop is the waker's goroutine: it reads the wake-up lists of the
// keys with waiters, one BLPOP at a time, until none has any (or the
// Semaphore is closed).
//
// Its reads run beside the keepers' calls, so a wake-up it pops may be
// read after a keep call that ran later in Redis: one that swept the
// grant as lapsed (the wake-up read between the lapse and the sweep) and
// found the waiter not granted, setting its since after the grant. A
// lease delivered from the wake-up is therefore timed from its waiter's
// since as it was when the read was made, which a call that ran before
// the read set (a waiter that came later: from when it entered); where
// that leaves the lease too little time, deliver asks the keeper for a
// keep call instead, which reports the time Redis has left on it.
func (s *Semaphore) wakeLoop() {
	m := s.waker
	for {
		s.mu.Lock()
		lists := make(map[string]string)
		since := make(map[string]time.Time)
		for key, r := range s.rooms { // in random order: see maxWakeLists
			if len(lists) == m.max {
				break
			}
			if r.waitingLocked() {
				lists[s.wakeList(key)] = key
				for id, w := range r.waiters {
					since[id] = w.since
				}
			}
		}
		if len(lists) == 0 || s.closed {
			m.running = false
			s.mu.Unlock()
			return
		}
		m.lists, m.kicked = lists, false
		s.mu.Unlock()

		read := s.readWakes(lists, since)

		s.mu.Lock()
		m.lists = nil
		s.mu.Unlock()
		if !read {
			// No connection to spare for it: the keepers' polls find the
			// grants until the next try.
			select {
			case <-time.After(min(s.poll, maxBlock)):
			case <-m.poke:
			case <-s.quit:
			}
		}
	}
}

// readWakes makes one blocking read of lists (and of the waker's own list)
// for up to a poll interval (and maxBlock), and delivers the wake-up it
// pops, timed from since (by waiter id; see wakeLoop). It returns false,
// at once, if the engine has no connection to spare for it (see block).
func (s *Semaphore) readWakes(lists map[string]string, since map[string]time.Time) bool {
	// As a keeper's read lasts until its next poll: a read's wake-up
	// times its lease by since, which is older the longer the read.
	d := max(min(maxBlock, s.poll), 10*time.Millisecond)
	// The process's one read waits for a connection, queued with its
	// calls, for up to as long as it would block: under a pool its calls
	// keep busy, a read that gave up at once would never be made.
	hctx, hcancel := context.WithTimeout(context.Background(), d)
	release, ok := s.eng.HoldConnWait(hctx, s.waker.ctl)
	hcancel()
	if !ok {
		return false
	}
	ctx, cancel := s.readContext(d)
	defer cancel()
	// names: the lists, its own last (BLPOP pops from the first list that
	// holds anything, so a wake-up goes before a kick); the drain below
	// names them in the same order.
	names := make([]string, 0, len(lists)+1)
	for list := range lists {
		names = append(names, list)
	}
	names = append(names, s.waker.ctl)
	prefixed := make([]string, len(names))
	for i, n := range names {
		prefixed[i] = s.eng.Prefix() + n
	}
	cmd := s.blpopCall(ctx, d, prefixed)
	release()
	vals, err := cmd.Result()
	switch {
	case errors.Is(err, redis.Nil): // timed out: read again
	case err != nil:
		// Redis unreachable: wait a while rather than spin; the keepers'
		// keep calls report it.
		select {
		case <-time.After(maxBlock):
		case <-s.quit:
		}
	case len(vals) == 2:
		s.deliverWake(lists[strings.TrimPrefix(vals[0], s.eng.Prefix())], vals[1], since)
		if len(lists) < 2 {
			break // one key's wake-ups: the next read pops the next
		}
		// Wake-ups come in bursts (a process releasing many keys): take
		// the others the lists hold now in one call, rather than one read
		// each, and any kicks piled up on the waker's own list.
		dctx, dcancel := s.detach(context.Background())
		raw, err := s.eng.RunScript(dctx, drainScript, names)
		dcancel()
		pairs, _ := raw.([]any)
		for i := 0; err == nil && i+1 < len(pairs); i += 2 {
			n, _ := pairs[i].(int64)
			v, _ := pairs[i+1].(string)
			if n >= 1 && int(n) < len(names) {
				s.deliverWake(lists[names[n-1]], v, since)
			}
		}
	}
	return true
}

// drainScript pops, without blocking, what the lists KEYS hold (up to 64
// entries each), and answers {i, entry, ...}, i the list's place in KEYS
// from 1.
var drainScript = throttle.NewScript(`local out = {}
for i = 1, #KEYS do
  for _ = 1, 64 do
    local v = redis.call('LPOP', KEYS[i])
    if not v then break end
    out[#out + 1] = i
    out[#out + 1] = v
  end
end
return out`)

// deliverWake delivers wake-up v read from key's list (key "" for none),
// timed from since (see wakeLoop).
func (s *Semaphore) deliverWake(key, v string, since map[string]time.Time) {
	if key == "" {
		return // a kick
	}
	if g, ok := parseWake(v); ok {
		g.waked, g.before = true, since[g.id]
		s.deliver(key, []grant{g})
	}
}

// kick ends the waker's read in progress with an empty entry on its own
// list, so that its next read names the lists of keys that began waiting
// meanwhile.
func (s *Semaphore) kick() {
	s.pushWakes(context.Background(), []string{s.waker.ctl})
}
