package throttle

import (
	"cmp"
	"context"
	_ "embed"
	"errors"
	"fmt"
	"math"
	"reflect"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/internal/waitbound"
)

var (
	//go:embed scripts/clock.lua
	clockSrc string

	//go:embed scripts/book.lua
	bookSrc    string
	bookScript = newScript(clockSrc + bookSrc)

	//go:embed scripts/book1.lua
	book1Src    string
	book1Script = newScript(book1Src) // stands alone: see the script

	//go:embed scripts/bookmany.lua
	bookManySrc    string
	bookManyScript = newScript(clockSrc + bookManySrc)

	//go:embed scripts/refund.lua
	refundSrc    string
	refundScript = newScript(clockSrc + refundSrc)

	//go:embed scripts/heartbeat.lua
	heartbeatSrc    string
	heartbeatScript = newScript(heartbeatSrc)

	//go:embed scripts/block.lua
	blockSrc    string
	blockScript = newScript(clockSrc + blockSrc)

	//go:embed scripts/reset.lua
	resetSrc    string
	resetScript = newScript(resetSrc)
)

// Defaults for New.
const (
	DefaultPrefix  = "slotbook:"
	DefaultTimeout = 50 * time.Millisecond
)

// MaxKeyLen is the longest key (before the prefix) the engine accepts.
const MaxKeyLen = 1024

// MaxBatch is the most requests one BookBatch call takes.
const MaxBatch = 1000

// MaxLimits is the most limits one subject may have (BookAll and friends).
const MaxLimits = 8

// MaxHorizon is the furthest ahead a slot may be booked (366 days): a
// Request's MaxWait beyond it counts as MaxHorizon, and a stored TAT
// further ahead than any booking within it could reach is ErrCorruptState.
const MaxHorizon = 366 * 24 * time.Hour

// Forever, as a Request's MaxWait, accepts a slot however far away it is,
// up to MaxHorizon.
const Forever = time.Duration(math.MaxInt64)

// An Engine books GCRA slots in Redis. It holds no state of its own besides
// its configuration: all limiter state is in Redis, one integer per key, so
// any number of Engines in any number of processes share one quota per key.
//
// An Engine is safe for concurrent use. Build one with New; the zero Engine
// is not usable.
type Engine struct {
	rdb      redis.Scripter
	prefix   string
	timeout  time.Duration
	observer Observer
	breakers *breakers // one per Redis node
	addr     string    // the node of a client that is not a Cluster (its address)
	// gates hold, per Redis node, one token per connection of the
	// client's pool for that node (nil when the pool's size is unknown). A
	// call takes a token before its timeout starts, so a caller queueing
	// for a connection waits (bounded by its own context) instead of timing
	// out: the client's own saturation is never mistaken for Redis being
	// down.
	gates *gates
	// For a Ring (whose calls are not gated): the most blocking commands
	// HoldConn lets hold a connection at once, half a shard's pool, and
	// how many do.
	ringHoldCap int32
	ringHolds   atomic.Int32
	// ring is the client if it is a Ring: each shard is a node of its own
	// (see ringRef), as each master of a Cluster is.
	ring *redis.Ring

	// clientBound is the longest of the client's own read, write and dial
	// timeouts when all are set (0 otherwise): where it is no longer than
	// a call's timeout, the client bounds each step of the call already,
	// and the engine adds no deadline of its own (see bound).
	clientBound time.Duration

	cluster *redis.ClusterClient // rdb, if it is a Cluster client
	fixed   *nodeRef             // the one node of a client that is not a Cluster
	refs    sync.Map             // node name -> *nodeRef, one per node ever called
	slots   *slotCache           // for a Cluster: each slot's node, as last looked up

	// For a Cluster: unread is the pseudo-node calls are counted against
	// while the client cannot read the slot map (see nodeFor); sweepAt is
	// when the next sweep of stale breakers may run, in monoNow
	// nanoseconds (see sweep); sweeping is set while one runs.
	unread   *nodeRef
	sweepAt  atomic.Int64
	sweeping atomic.Bool

	// merge gathers single bookings that find every connection busy into
	// one call (nil where it is not used: see merger).
	merge     *merger
	noMerging bool          // WithMerging(false)
	mergeAt   int           // WithMergeAt; 0 until New sets the default
	mergeWait time.Duration // WithMergeWait; 0 until New sets the default
}

// unreadNode names the pseudo-node of a Cluster whose slot map cannot be
// read.
const unreadNode = "cluster"

// nodeRef is what a call needs of its Redis node: its name, its breaker
// and its connection gate (nil when the pool's size is unknown).
type nodeRef struct {
	name string
	b    *breaker
	gate chan struct{}
	// blocking counts the gate's tokens held by blocking commands
	// (HoldConn): at most half the gate.
	blocking atomic.Int32
}

// ref returns node's nodeRef, creating it on first use.
func (e *Engine) ref(node string) *nodeRef {
	if r, ok := e.refs.Load(node); ok {
		return r.(*nodeRef)
	}
	r, _ := e.refs.LoadOrStore(node, &nodeRef{name: node, b: e.breakers.get(node), gate: e.gates.of(node)})
	return r.(*nodeRef)
}

// slotCache remembers, per Redis Cluster hash slot, the node that the
// client's slot map last named for it, so that a call does not look it up
// (under a timeout context of its own) every time. An entry is trusted for
// slotCacheTTL, and dropped at once when a call to its node fails as
// unavailable or is refused by the node's open breaker, or when a sweep
// closes the node's breaker (see Engine.sweep), so that after a failover
// or a resharding calls are soon counted against the node that now serves
// the slot. (The node only picks the breaker a call is counted against:
// the client routes the command by its own slot map.)
type slotCache [clusterSlots]atomic.Pointer[slotEntry]

type slotEntry struct {
	ref *nodeRef
	at  int64 // monoNow when looked up
}

// slotCacheTTL is how long a slot's cached node is trusted.
const slotCacheTTL = time.Second

// clusterSlots is the number of Redis Cluster hash slots.
const clusterSlots = 16384

// keySlot returns the Redis Cluster hash slot of a (prefixed) key: CRC16
// (XMODEM) of its hash tag, or of the whole key if it has none, modulo
// 16384, as the cluster spec defines it.
func keySlot(key string) int {
	if tag := HashTag(key); tag != "" {
		key = tag
	}
	var crc uint16
	for i := 0; i < len(key); i++ {
		crc = crc<<8 ^ crc16Table[byte(crc>>8)^key[i]]
	}
	return int(crc) % clusterSlots
}

// crc16Table is the table of CRC16/XMODEM (polynomial 0x1021).
var crc16Table = func() (t [256]uint16) {
	for i := range t {
		c := uint16(i) << 8
		for range 8 {
			if c&0x8000 != 0 {
				c = c<<1 ^ 0x1021
			} else {
				c <<= 1
			}
		}
		t[i] = c
	}
	return t
}()

// gates are the engine's per-node connection gates (see Engine.gates).
type gates struct {
	size   int                      // tokens per node: the pool's size
	mu     sync.Mutex               // guards byNode
	byNode map[string]chan struct{} // entries are never removed (one per node ever called)
}

// of returns node's gate, or nil if g is.
func (g *gates) of(node string) chan struct{} {
	if g == nil {
		return nil
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	c, ok := g.byNode[node]
	if !ok {
		c = make(chan struct{}, g.size)
		g.byNode[node] = c
	}
	return c
}

// An Option configures an Engine in New.
type Option func(*Engine) error

// WithPrefix sets the prefix put before every key (default "slotbook:").
// A prefix may not hold a brace ('{' or '}'): Redis Cluster hashes a key
// by the part between its first '{' and the first '}' after it, so a
// brace in the prefix would change the slot of every key, parting the
// keys of one subject (its limits, its refunds' tombstones) that must
// share one.
func WithPrefix(prefix string) Option {
	return func(e *Engine) error {
		if strings.ContainsAny(prefix, "{}") {
			return fmt.Errorf("throttle: prefix %q: want no '{' or '}' (they would change the keys' hash slot)", prefix)
		}
		e.prefix = prefix
		return nil
	}
}

// WithTimeout bounds every Redis call the Engine makes (default 50ms). Zero
// means no bound beyond the caller's context and the client's own
// timeouts. The bound must cover a reconnect, not only a round trip: a
// call that finds no idle connection dials and sends HELLO (and AUTH)
// within it, two round trips more than the call itself (more with TLS),
// and a call that times out costs its connection, so a bound below that
// lets no call through under load once connections are lost (the package
// doc has more). The 50ms default suits a server a few milliseconds
// away. A bound needs a go-redis client built with ContextTimeoutEnabled:
// true (without it a context deadline does not cut a socket read short);
// New reports a client that lacks it.
//
// The bound costs a timer per call, which the engine saves where it is
// not needed: when the caller's context has a deadline no later than the
// bound, and when the client's own ReadTimeout, WriteTimeout and
// DialTimeout are all set and none is longer than the bound (each step
// of a call is then cut short by the client: a Client or ClusterClient
// only). In the second case a call that has to dial is bounded by the
// client's DialTimeout per attempt, with its DialerRetries, and one that
// waits for a pooled connection inside the client by its PoolTimeout (a
// saturated client, see the package doc), rather than by the engine's
// timeout as a whole.
func WithTimeout(d time.Duration) Option {
	return func(e *Engine) error {
		if d < 0 {
			return fmt.Errorf("throttle: negative timeout %v", d)
		}
		e.timeout = d
		return nil
	}
}

// WithMerging turns merging on or off (on by default). With it, single
// bookings (BookAll of one request under one limit, as package reserve
// sends for a caller alone; not the check mode of Allow, whose callers
// want an answer now, cut short by their context) that find every
// connection to Redis busy, or WithMergeAt's count of bookings in flight,
// wait together and go out in one call when one frees, instead of one
// call each: at many keys and many callers this costs much less CPU per
// booking, in Redis and in the client. Each booking is judged as it would
// be alone. It is used only where it can be: a client that is not a
// Cluster's (whose keys may lie on different nodes), whose pool size is
// known (a go-redis Client), and an engine with a timeout (which bounds
// the merged call, since no one request's context may cut it short). See
// the package doc for how a merged call's errors reach each booking.
func WithMerging(on bool) Option {
	return func(e *Engine) error {
		e.noMerging = !on
		return nil
	}
}

// defaultMergeAt is WithMergeAt's default.
const defaultMergeAt = 4

// WithMergeAt sets how many single bookings (and merged calls) may be in
// flight to Redis at once before further ones are merged (WithMerging):
// a booking that finds that many in flight waits for one of them to
// come back, with the other bookings that arrive meanwhile, and they go
// out in one call. Redis runs one command at a time, so calls beyond a
// few in flight only queue there, each costing a round of the client's
// and the server's work; merged, they share one. The wait is short
// (WithMergeWait): where Redis is far away, the calls in flight are on
// the wire rather than queued in Redis, and a batch that waited a whole
// round trip for one of them would double its callers' latency; it goes
// without waiting further. The default is 4; a count at or above the
// client's pool size merges only when every connection is busy. It has
// no effect where merging is off.
func WithMergeAt(inFlight int) Option {
	return func(e *Engine) error {
		if inFlight < 1 {
			return fmt.Errorf("throttle: WithMergeAt(%d): want at least 1", inFlight)
		}
		e.mergeAt = inFlight
		return nil
	}
}

// defaultMergeWait is WithMergeWait's default: longer than a call takes
// in Redis on loopback or in one data centre's network, when Redis is
// the bottleneck, and far shorter than a round trip to a Redis further
// away.
const defaultMergeWait = 250 * time.Microsecond

// WithMergeWait sets how long a batch of merged bookings waits, from when
// it formed, for one of the calls WithMergeAt counts in flight to come
// back (default 250µs). If none has by then, the batch goes out anyway,
// beside them: so a booking waits at most d longer than it would alone
// (its call's round trip aside). The calls beyond the count carry full
// batches (64 bookings), batches that waited d (at most one that is not
// full per d), and bookings a merged call could not book (a corrupt key;
// a key the ACL user may not touch, which fails the whole call), each sent
// again alone once a call in flight lands or d has passed, so those may go
// out together. Forever holds the count strictly: batches wait as long as
// it takes, for a Redis whose CPU is the bottleneck and which is so near
// that its round trip costs little. A booking's own context still bounds
// its wait (see the package doc).
func WithMergeWait(d time.Duration) Option {
	return func(e *Engine) error {
		if d <= 0 {
			return fmt.Errorf("throttle: WithMergeWait(%v): want a positive wait", d)
		}
		e.mergeWait = d
		return nil
	}
}

// WithObserver reports every decision, Redis call, refund and breaker
// change to o (package metrics has one for Prometheus). A nil o is an
// error, and so is a nil pointer (map, func, channel, slice) in a non-nil
// interface, such as a nil *metrics.Collector, whose methods would panic
// on the first call, possibly on one of the library's own goroutines.
func WithObserver(o Observer) Option {
	return func(e *Engine) error {
		if o == nil {
			return errors.New("throttle: nil observer")
		}
		if nilInside(o) {
			return fmt.Errorf("throttle: nil observer (a nil %T)", o)
		}
		e.observer = o
		return nil
	}
}

// nilInside reports whether v, a non-nil interface, holds a nil pointer,
// map, func, channel, slice or interface.
func nilInside(v any) bool {
	switch rv := reflect.ValueOf(v); rv.Kind() {
	case reflect.Pointer, reflect.Map, reflect.Func, reflect.Chan, reflect.Slice, reflect.Interface, reflect.UnsafePointer:
		return rv.IsNil()
	}
	return false
}

// WithProbeBackoff sets how often, while Redis is unavailable, one call is
// let through to see whether it is back: first after min, then doubling up
// to max (defaults DefaultProbeMin, DefaultProbeMax). The probe, the one
// call under way while the breaker is open, may take four times the
// engine's timeout.
func WithProbeBackoff(min, max time.Duration) Option {
	return func(e *Engine) error {
		if min <= 0 || max < min {
			return fmt.Errorf("throttle: probe backoff %v to %v: want 0 < min <= max", min, max)
		}
		e.breakers.min, e.breakers.max = min, max
		return nil
	}
}

// New returns an Engine that runs its scripts through rdb: a go-redis
// Client, ClusterClient, Ring or failover client all fit, built with
// ContextTimeoutEnabled: true unless WithTimeout(0) is given. New makes no
// network call; the scripts are sent on first use (or by Load).
func New(rdb redis.Scripter, opts ...Option) (*Engine, error) {
	if rdb == nil {
		return nil, errors.New("throttle: nil Redis client")
	}
	e := &Engine{
		rdb: rdb, prefix: DefaultPrefix, timeout: DefaultTimeout, observer: nopObserver{},
		breakers: newBreakers(), addr: "redis",
	}
	for _, opt := range opts {
		if err := opt(e); err != nil {
			return nil, err
		}
	}
	if e.timeout > 0 && !contextTimeouts(rdb) {
		return nil, errors.New("throttle: the go-redis client does not let a context deadline cut a call short, " +
			"so the engine's timeout would not hold: build it with ContextTimeoutEnabled: true (or pass WithTimeout(0))")
	}
	e.breakers.obs = e.observer
	e.breakers.nodeObs, _ = e.observer.(NodeObserver)
	if c, ok := rdb.(*redis.Client); ok {
		e.addr = c.Options().Addr
	}
	if n := poolSize(rdb); n > 0 {
		e.gates = &gates{size: n, byNode: make(map[string]chan struct{})}
	}
	if r, ok := rdb.(*redis.Ring); ok {
		e.ring = r
		n := r.Options().PoolSize
		if n <= 0 {
			n = 10 * runtime.GOMAXPROCS(0) // go-redis's default, per shard
		}
		e.ringHoldCap = int32(n / 2)
	}
	e.clientBound = clientBound(rdb)
	if c, ok := rdb.(*redis.ClusterClient); ok {
		e.cluster = c
		e.slots = new(slotCache)
		e.unread = e.ref(unreadNode)
	} else {
		e.fixed = e.ref(e.addr)
		if e.fixed.gate != nil && e.timeout > 0 && !e.noMerging {
			e.merge = &merger{e: e, wait: cmp.Or(e.mergeWait, defaultMergeWait)}
			if k := cmp.Or(e.mergeAt, defaultMergeAt); k < cap(e.fixed.gate) {
				e.merge.flight = make(chan struct{}, k)
				e.merge.landFn = e.merge.land
			}
		}
	}
	return e, nil
}

// clientBound returns the longest of rdb's read, write and dial timeouts,
// or 0 if any is unset (no bound) or rdb is of a kind whose options are
// not read here.
func clientBound(rdb redis.Scripter) time.Duration {
	var r, w, d time.Duration
	switch c := rdb.(type) {
	case *redis.Client:
		o := c.Options()
		r, w, d = o.ReadTimeout, o.WriteTimeout, o.DialTimeout
	case *redis.ClusterClient:
		o := c.Options()
		r, w, d = o.ReadTimeout, o.WriteTimeout, o.DialTimeout
	default:
		return 0
	}
	if r <= 0 || w <= 0 || d <= 0 {
		return 0
	}
	return max(r, w, d)
}

// poolSize returns the size of rdb's connection pool for one node (a
// Cluster client keeps one such pool per node), or 0 where it is unknown
// (a Ring's shards, or a client of another kind).
func poolSize(rdb redis.Scripter) int {
	switch c := rdb.(type) {
	case *redis.Client:
		return c.Options().PoolSize
	case *redis.ClusterClient:
		return c.Options().PoolSize
	}
	return 0
}

// contextTimeouts reports whether rdb lets a context deadline cut a socket
// read short, as far as can be told (a client of another kind is trusted).
func contextTimeouts(rdb redis.Scripter) bool {
	switch c := rdb.(type) {
	case *redis.Client:
		return c.Options().ContextTimeoutEnabled
	case *redis.ClusterClient:
		return c.Options().ContextTimeoutEnabled
	case *redis.Ring:
		return c.Options().ContextTimeoutEnabled
	}
	return true
}

// Observer returns the engine's observer (a no-op one if none was set), for
// layers above that make decisions of their own, such as fallbacks.
func (e *Engine) Observer() Observer { return e.observer }

// Unavailable reports whether calls are failing fast because Redis is
// unavailable, and if so how long until the next probe (while a probe is
// under way, at least the shortest probe interval: never 0). The engine
// keeps one breaker per Redis node (per master of a Cluster, per shard of
// a Ring): Unavailable reports whether any is open, and the soonest probe;
// UnavailableFor reports on the node of one key. With a Ring, while a
// breaker is open, the breakers of shards the Ring's heartbeat has marked
// down (their keys go to other shards, so no probe reaches them) are
// closed, at most once per the longest probe interval, with no Redis call. With a Cluster, while a breaker is
// open a call has the cluster's slot map read, on a goroutine of its own
// that no call waits for, at most once per the longest probe interval
// (see WithProbeBackoff), and the breaker of any node that
// masters no slot any more (a master replaced in a failover) is closed;
// the breaker of the pseudo-node "cluster" is closed once the map can be
// read. Neither keeps Unavailable true after the cluster serves every
// slot again and calls are made.
func (e *Engine) Unavailable() (bool, time.Duration) {
	return e.breakers.state()
}

// UnavailableFor is Unavailable for the Redis node that holds key (as
// given to the engine's other methods, before the prefix): with a Redis
// Cluster, whether calls for key fail fast because the master that owns
// its slot is unavailable, while other masters may serve; with a Ring, the
// shard the key goes to. With another client it is Unavailable. It makes no Redis call while the slot map
// cannot be read (it then reports on the pseudo-node "cluster"), nor once
// a Cluster client has read the map.
func (e *Engine) UnavailableFor(ctx context.Context, key string) (bool, time.Duration) {
	return e.breakers.stateOf(e.node(ctx, e.prefix+key))
}

// Node names the Redis node that holds key (as given to the engine's
// other methods, before the prefix): the failure domain with a breaker of
// its own, named as NodeObserver names it: a Cluster master's address (or
// "cluster" while the slot map cannot be read), a Ring shard's address
// (or "redis" while the Ring has no shard up), a plain client's address,
// or "redis" for another kind of client. Keys of one name share a
// breaker, so a judgement that Redis is away, made from calls for one
// key, holds for the others of its node and no further: package lease
// counts its leave rounds that found Redis away by Node (helper-146,
// helper-147). It makes no Redis call in the cases UnavailableFor makes
// none, nor for a Ring.
func (e *Engine) Node(ctx context.Context, key string) string {
	return e.node(ctx, e.prefix+key)
}

// node names the Redis node (the failure domain, with a breaker of its
// own) that holds the prefixed key: for a Cluster, the address of the
// master that owns the key's slot, as far as the client's slot map knows
// ("cluster" if it cannot be read: the client reads it on first use);
// for a plain client, its address; for other clients, "redis". Unlike a
// call, it never reads the slot map while the breaker of "cluster" is
// open.
func (e *Engine) node(ctx context.Context, key string) string {
	if e.ring != nil {
		return e.ringRef(key).name
	}
	if e.cluster == nil {
		return e.fixed.name
	}
	r, _, _ := e.lookup(ctx, key, time.Now(), false)
	return r.name
}

// nodeFor returns the nodeRef of the node that holds the prefixed key (see
// node), for a call starting at now, and whether it came from the slot
// cache (a Cluster's, looked up within slotCacheTTL before now) with no
// Redis call made. For a Cluster it first sweeps stale breakers, when one
// is due (see sweep). probeErr is the error of the call's reading of the
// slot map when that was the probe of "cluster" and failed (see lookup):
// the call's own error.
func (e *Engine) nodeFor(ctx context.Context, key string, now time.Time) (r *nodeRef, cached bool, probeErr error) {
	if e.ring != nil {
		e.sweepRing(now)
		return e.ringRef(key), false, nil
	}
	if e.cluster == nil {
		return e.fixed, false, nil
	}
	e.sweep(ctx, now)
	return e.lookup(ctx, key, now, true)
}

// ringRef returns the nodeRef of the Ring shard the prefixed key goes to
// (the Ring's own choice, no Redis call), or the engine's fixed one,
// "redis", while the Ring has no shard up. Each shard has a breaker of its
// own: one shard stopped fails only the keys it holds, not the Ring's
// every call (helper-149: a lease's leave calls for keys on a shard that
// answered waited out the TTL behind the one breaker's probes, taken by
// the stopped shard's keys).
func (e *Engine) ringRef(key string) *nodeRef {
	c, err := e.ring.GetShardClientForKey(key)
	if err != nil {
		return e.fixed
	}
	return e.ref(c.Options().Addr)
}

// sweepRing closes, at most once per the longest probe interval and only
// while some breaker is open, the breakers of Ring shards that are not up
// (the Ring's heartbeat marked them down, or they left its addresses), and
// that of "redis" once a shard is up: no call goes to them, so no probe
// could close them, and Unavailable would report the Ring unavailable for
// good. The Ring's own view, no Redis call.
func (e *Engine) sweepRing(now time.Time) {
	if !e.breakers.anyOpen() {
		return // the common case: no lock (helper-150)
	}
	mono := monoNow(now)
	due := e.sweepAt.Load()
	if mono < due {
		return
	}
	if !e.sweepAt.CompareAndSwap(due, mono+int64(e.breakers.max)) {
		return
	}
	up := map[string]bool{}
	for _, c := range e.ring.GetShardClients() {
		up[c.Options().Addr] = true
	}
	if len(up) == 0 {
		return
	}
	e.breakers.retire(func(node string) bool { return !up[node] })
}

// lookup is nodeFor for a Cluster, without the sweep. While the breaker
// of "cluster" is open (the slot map could not be read) only that
// breaker's probe reads the map: a call that finds the probe due takes it
// here, if mayProbe, and its reading of the map is the probe; every other
// call fails fast, as calls to any node with an open breaker do, instead
// of each waiting out the timeout on a map that cannot be read. Once the
// map is read, the breaker of "cluster" is closed (no call maps to it any
// more). probeErr is the error of a probe that failed.
func (e *Engine) lookup(ctx context.Context, key string, now time.Time, mayProbe bool) (r *nodeRef, cached bool, probeErr error) {
	slot := &e.slots[keySlot(key)]
	mono := monoNow(now)
	if en := slot.Load(); en != nil && mono-en.at < int64(slotCacheTTL) {
		return en.ref, true, nil
	}
	probing := false
	if e.unread.b.open.Load() {
		if !mayProbe {
			return e.unread, false, nil
		}
		ok, probe := e.breakers.allowB(e.unread.b)
		if !ok {
			return e.unread, false, nil // the probe is not due, or under way
		}
		probing = probe // else closed meanwhile: an ordinary lookup
	}
	callCtx, cancel := e.callContext(ctx)
	defer cancel()
	m, err := e.cluster.MasterForKey(callCtx, key)
	if err != nil {
		if !probing {
			return e.unread, false, nil
		}
		if ended := e.callerEnded(ctx, callCtx, err); ended != nil {
			e.breakers.abandonB(e.unread.b)
			return e.unread, false, ended
		}
		e.breakers.probeFailedB(e.unread.b, now)
		return e.unread, false, fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	if e.unread.b.open.Load() {
		e.breakers.successB(e.unread.b, time.Now()) // the map was read
	}
	r = e.ref(m.Options().Addr)
	slot.Store(&slotEntry{ref: r, at: mono})
	return r, false, nil
}

// sweep closes the breakers of Cluster nodes that no call maps to any
// more (see breakers.retire): it reads the slot map through the client's
// ForEachMaster, which reloads the client's map from the cluster (one
// round trip, within the engine's timeout; the map the client holds if
// that fails), and retires every open breaker whose node masters no slot.
// So after a failover the dead master's breaker closes, and the client
// routes to the promoted replica without waiting for its own periodic
// reload. A call starts it, at most once per the longest probe interval
// (see WithProbeBackoff), and only while some breaker is open and that of
// "cluster" is not (the map could be read); it runs on a goroutine of its
// own, one at a time, so that no call waits for it (on the path of a
// call, it held that call for the whole timeout whenever go-redis asked a
// node that did not answer for the map: while one master hung, callers of
// subjects on masters that answered failed their deadlines). It ends
// within the engine's timeout, or, with none, within the longest probe
// interval or a second, whichever is longer (it is no caller's call, and
// a hung master would hold it for good).
func (e *Engine) sweep(ctx context.Context, now time.Time) {
	if !e.breakers.anyOpen() {
		return // the common case: no lock (helper-150)
	}
	mono := monoNow(now)
	if mono < e.sweepAt.Load() {
		return
	}
	if e.unread.b.open.Load() {
		return
	}
	// One at a time; a call that finds one under way leaves the next due
	// for a call after it.
	if !e.sweeping.CompareAndSwap(false, true) {
		return
	}
	due := e.sweepAt.Load()
	if mono < due || !e.sweepAt.CompareAndSwap(due, mono+int64(e.breakers.max)) {
		e.sweeping.Store(false)
		return
	}
	go func() {
		defer e.sweeping.Store(false)
		e.sweepNow(context.WithoutCancel(ctx))
	}()
}

// sweepNow is sweep's reading of the slot map.
func (e *Engine) sweepNow(ctx context.Context) {
	d := e.timeout
	if d <= 0 {
		d = max(e.breakers.max, time.Second)
	}
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	var mu sync.Mutex // guards masters
	masters := map[string]bool{}
	err := e.cluster.ForEachMaster(ctx, func(_ context.Context, m *redis.Client) error {
		mu.Lock()
		masters[m.Options().Addr] = true
		mu.Unlock()
		return nil
	})
	if err != nil || len(masters) == 0 {
		return
	}
	retired := e.breakers.retire(func(node string) bool { return !masters[node] })
	if len(retired) == 0 {
		return
	}
	// Calls for slots cached on a retired node look them up again.
	for i := range e.slots {
		if en := e.slots[i].Load(); en != nil && slices.Contains(retired, en.ref.name) {
			e.slots[i].CompareAndSwap(en, nil)
		}
	}
}

// forgetSlot drops the cached node of the prefixed key's slot, if any.
func (e *Engine) forgetSlot(key string) {
	if e.slots != nil {
		e.slots[keySlot(key)].Store(nil)
	}
}

// Load sends the engine's scripts to Redis, so that the first booking does
// not pay for a NOSCRIPT round trip. Calling it is optional. Each Redis
// node gets the scripts in one round trip (a pipeline) within the engine's
// timeout; a Cluster's nodes, masters and replicas, each within its own,
// after the slot map is read within another; a Ring's shards each within
// its own. Through another kind of client each script is sent on its own,
// within its own timeout.
func (e *Engine) Load(ctx context.Context) error {
	var err error
	switch c := e.rdb.(type) {
	case *redis.Client:
		err = e.loadNode(ctx, c)
	case *redis.ClusterClient:
		mctx, cancel := e.callContext(ctx)
		defer cancel()
		err = c.ForEachShard(mctx, func(_ context.Context, n *redis.Client) error { return e.loadNode(ctx, n) })
	case *redis.Ring:
		// A keyless SCRIPT LOAD through a Ring goes to one shard at random.
		err = c.ForEachShard(ctx, func(_ context.Context, n *redis.Client) error { return e.loadNode(ctx, n) })
	default: // another Scripter
		for _, s := range engineScripts {
			sctx, cancel := e.callContext(ctx)
			err = s.Load(sctx, e.rdb).Err()
			cancel()
			if err != nil {
				break
			}
		}
	}
	if err != nil {
		return fmt.Errorf("throttle: load scripts: %w", err)
	}
	return nil
}

// engineScripts are the scripts Load sends.
var engineScripts = []*script{bookScript, book1Script, bookManyScript, bookRetryScript, refundScript, heartbeatScript, blockScript, resetScript, windowScript, stateScript}

// loadNode sends the scripts to the one node of c in one pipeline, within
// the engine's timeout.
func (e *Engine) loadNode(ctx context.Context, c *redis.Client) error {
	ctx, cancel := e.callContext(ctx)
	defer cancel()
	_, err := c.Pipelined(ctx, func(p redis.Pipeliner) error {
		for _, s := range engineScripts {
			p.ScriptLoad(ctx, s.src)
		}
		return nil
	})
	return err
}

// Heartbeat records that the process id is alive under name for ttl and
// returns how many processes are (at least 1). Fallback policies that share
// the limit locally while Redis is down use it, once per interval, never
// per request. The set lives at the key "instances:"+name (prefixed). Its
// errors are classed as every call's (ErrUnavailable, ErrReplyLost; see the
// package doc), but it does not go through the breaker.
func (e *Engine) Heartbeat(ctx context.Context, name, id string, ttl time.Duration) (int, error) {
	if name == "" || id == "" || ttl < time.Millisecond {
		return 0, fmt.Errorf("%w: heartbeat needs a name, an id and a TTL of at least 1ms", ErrInvalidRequest)
	}
	ms := int64(ttl / time.Millisecond)
	callCtx, cancel := e.callContext(ctx)
	defer cancel()
	key := e.prefix + "instances:" + name
	reply, err := heartbeatScript.run(callCtx, e.rdb, []string{key}, []any{id, ms})
	if err != nil {
		// Classed as every call is (the package doc's table), but outside
		// the breaker: the fallbacks call it while Redis is down.
		_, err = e.verdict(ctx, callCtx, key, err)
		return 0, fmt.Errorf("throttle: heartbeat %q: %w", name, err)
	}
	n, ok := reply.(int64)
	if !ok {
		return 0, fmt.Errorf("throttle: heartbeat %q: %w", name, unreadable(fmt.Errorf("unexpected reply %T, want an integer", reply)))
	}
	return max(int(n), 1), nil
}

func (e *Engine) callContext(ctx context.Context) (context.Context, context.CancelFunc) {
	if e.timeout <= 0 {
		return waitbound.Of(ctx), noCancel // the caller's context bounds the call (see bound)
	}
	return context.WithTimeout(ctx, e.timeout)
}

// bound returns ctx bounded by the timeout d of a call starting at now, as
// withTimeout does, but without a timer of its own where none is needed:
// where ctx's own deadline comes no later, or where the client's own
// timeouts bound each step of the call (clientBound, no longer than d).
// A call's errors are classed the same either way (see callerEnded).
func (e *Engine) bound(ctx context.Context, d time.Duration, now time.Time) (context.Context, context.CancelFunc) {
	if d <= 0 {
		// No timeout: the caller's context bounds the call, its deadline
		// included where package reserve hid it (see waitbound).
		return waitbound.Of(ctx), noCancel
	}
	if e.clientBound > 0 && e.clientBound <= d {
		return ctx, noCancel
	}
	if dl, ok := ctx.Deadline(); ok && !dl.After(now.Add(d)) {
		return ctx, noCancel
	}
	return context.WithDeadline(ctx, now.Add(d))
}

func noCancel() {}

// withTimeout bounds ctx by d, if d is positive.
func withTimeout(ctx context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	if d > 0 {
		return context.WithTimeout(ctx, d)
	}
	return ctx, func() {}
}

// int64s checks that reply is an array of exactly want integers.
func int64s(reply any, want int) ([]int64, error) { return int64sCap(reply, want, 0) }

// int64sCap is int64s with room for extra more values after the reply's,
// zero, within the returned slice's length (want+extra).
func int64sCap(reply any, want, extra int) ([]int64, error) {
	arr, ok := reply.([]any)
	if !ok {
		return nil, fmt.Errorf("unexpected reply %T, want an array", reply)
	}
	if len(arr) != want {
		return nil, fmt.Errorf("unexpected reply of %d values, want %d", len(arr), want)
	}
	out := make([]int64, want+extra)
	for i, v := range arr {
		n, ok := v.(int64)
		if !ok {
			return nil, fmt.Errorf("unexpected reply value %d: %T, want an integer", i, v)
		}
		out[i] = n
	}
	return out, nil
}

func nowArg(ctx context.Context) string {
	if now, ok := testhook.Now(ctx); ok {
		return strconv.FormatInt(now, 10)
	}
	return ""
}

// checkKeysLimits validates the keys and limits of one subject: as many
// keys as limits, 1 to MaxLimits of them, no key twice, and (for more than
// one) a shared hash tag, so that a Redis Cluster can run the script.
func checkKeysLimits(keys []string, limits []Limit) error {
	if len(keys) == 0 || len(keys) > MaxLimits || len(keys) != len(limits) {
		return fmt.Errorf("%w: %d keys for %d limits (want 1 to %d of each, as many keys as limits)",
			ErrInvalidRequest, len(keys), len(limits), MaxLimits)
	}
	for i, k := range keys {
		if err := limits[i].Validate(); err != nil {
			return err
		}
		if err := CheckKey(k); err != nil {
			return err
		}
		for _, k2 := range keys[:i] {
			if k == k2 {
				return fmt.Errorf("%w: key %q given twice", ErrInvalidRequest, k)
			}
		}
		if i > 0 && HashTag(k) != HashTag(keys[0]) {
			return fmt.Errorf("%w: keys %q and %q do not share a hash tag, so a Redis Cluster may hold them on different nodes",
				ErrInvalidRequest, keys[0], k)
		}
	}
	if len(keys) > 1 && HashTag(keys[0]) == "" {
		return fmt.Errorf("%w: keys %q... of several limits need a hash tag ({...})", ErrInvalidRequest, keys[0])
	}
	return nil
}

// HashTag returns the part of key that Redis Cluster hashes: what stands
// between the first '{' and the next '}', if that is not empty; else "".
// Keys with the same non-empty hash tag live on one node.
func HashTag(key string) string {
	open := strings.IndexByte(key, '{')
	if open < 0 {
		return ""
	}
	end := strings.IndexByte(key[open+1:], '}')
	if end <= 0 {
		return ""
	}
	return key[open+1 : open+1+end]
}

// CheckKey reports whether key is acceptable to the engine: not empty, at
// most MaxKeyLen bytes, and, if it holds '{' or '}', with a hash tag (see
// HashTag), so that a Redis Cluster can place the keys that go with it
// (a refund's tombstone) on its node. The error matches ErrInvalidRequest.
func CheckKey(key string) error {
	if key == "" {
		return fmt.Errorf("%w: empty key", ErrInvalidRequest)
	}
	if len(key) > MaxKeyLen {
		return fmt.Errorf("%w: key of %d bytes (at most %d)", ErrInvalidRequest, len(key), MaxKeyLen)
	}
	if HashTag(key) == "" && strings.ContainsAny(key, "{}") {
		return fmt.Errorf("%w: key %q has braces but no hash tag (a non-empty {...})", ErrInvalidRequest, key)
	}
	return nil
}

// CheckRequest reports whether r can ever be granted under limit: the error
// matches ErrInvalidRequest for N <= 0 or a negative MaxWait, and
// ErrExceedsBurst for N > Burst+1.
func CheckRequest(r Request, limit Limit) error {
	if err := limit.Validate(); err != nil {
		return err
	}
	return checkRequest(r, limit)
}

// maxWaitMicros is r's max wait as the scripts take it, in microseconds,
// at most the horizon, rounded down: a wait of a whole microsecond more
// than MaxWait is more than the caller accepts.
func (r Request) maxWaitMicros() int64 { return int64(min(r.MaxWait, MaxHorizon) / time.Microsecond) }

// badInput reports whether err is one of bad input, found before any
// Redis call.
func badInput(err error) bool {
	return errors.Is(err, ErrInvalidRequest) || errors.Is(err, ErrInvalidLimit) || errors.Is(err, ErrExceedsBurst)
}

func checkRequest(r Request, limit Limit) error {
	switch {
	case r.N <= 0:
		return fmt.Errorf("%w: n = %d must be positive", ErrInvalidRequest, r.N)
	case r.N > limit.Burst+1:
		return fmt.Errorf("%w: n = %d > burst+1 = %d under %v", ErrExceedsBurst, r.N, limit.Burst+1, limit)
	case r.MaxWait < 0:
		return fmt.Errorf("%w: negative max wait %v", ErrInvalidRequest, r.MaxWait)
	}
	return nil
}
