// Package lease limits concurrency across processes: at most N holders per
// key at once, in every process that shares a Redis, an engine prefix and a
// semaphore name. It complements package reserve, which limits the rate.
//
//	sem, err := lease.New(eng, "partner", 5, lease.WithTTL(30*time.Second))
//	l, err := sem.Acquire(ctx, "tenant-42") // waits, first come first served
//	if err != nil { return err }
//	defer l.Release(ctx)
//
// # Leases
//
// A lease lives for the TTL unless extended. Each Semaphore runs one
// goroutine per key it holds or waits for (its keeper), which extends all
// of the process's leases of that key in one Redis call every TTL/3. A
// process that dies stops extending, and its leases lapse within the TTL
// of their last extension; the next call on the key drops them (counted by
// Observer.ObserveExpired). A holder that stalls for longer than the TTL
// finds its lease lost (Lease.Lost is closed, Release returns ErrLost).
// So does a holder cut off from Redis: Lost is closed once 9/10 of the
// TTL have passed since the last successful extension was sent, timed on
// the process's own clock, which is before Redis lets the lease lapse and
// another process take its place (the tenth allows for late timers on a
// busy machine). Each lease
// carries a fencing token, larger than every token granted before it
// for the key, for resources that must refuse a holder whose lease has
// lapsed.
//
// # Waiting
//
// Waiters join a queue in Redis (a sorted set scored by arrival) and are
// served in arrival order across every process: a release hands its lease
// to the head of the queue inside the same script, so no waiter has to
// ask again. The grant wakes the waiter's process through a per-process
// list of the key, on which the process blocks (BLPOP); a grant to a
// waiter of the calling process comes back in the reply itself. On a
// single Redis node (a redis.Client) one blocking read names the lists of
// every key the process has waiters for: one blocked connection per
// process, however many keys it waits on. On a Cluster or a Ring, where
// two keys' lists may live on two nodes, each key's keeper blocks on its
// own list: one blocked connection per process and key with waiters. In
// either case it is not one per waiter. A list was chosen over pub/sub because a pushed wake-up
// waits in the list until it is read, so a wake-up sent while its reader
// was between two reads is not lost; BLPOP on a hash-tagged key is routed
// to the key's node of a Redis Cluster like any command (pub/sub needs a
// dedicated connection per process, and sharded channels on a Cluster);
// and a release wakes only the process it granted to, never every
// waiter. As a fallback for a wake-up lost all the same (a process that
// restarted its connection), the keeper polls every poll interval (at
// most TTL/3 and 1 s by default) with the same call that refreshes its
// waiters in the queue; waiters whose process stops refreshing them leave
// the queue within the TTL, so a dead process cannot block it. A keep
// call that fails (a poll, or an extension) is tried again sooner than
// the interval, counted from its end and doubling after each further
// failure, up to the interval: one that reached no Redis (refused by the
// engine's open breaker, say) from the breaker's next probe, at least
// throttle.DefaultProbeMin on; one that reached it (its reply lost, or an
// error Redis answered) a quarter interval on. So a lost reply elsewhere,
// which opens the breaker and has the keep calls that come due beside
// its probe refused, costs the waiters a probe interval or two, not a
// poll; while Redis stays away, each keeper makes a few more calls, which
// the open breaker refuses without a round trip; and a slow Redis gets
// few more keep calls than one an interval. One failure is not tried
// again for the waiters: WRONGTYPE, one of the key's keys holding another
// Redis type (written by something else), which only deleting the key
// mends. The waiters' Acquire calls return it and leave the queue, as a
// first call that met it would have; leases held under the key are
// still given up (Lost) when their extensions have failed too long.
//
// A waiter whose context ends leaves the queue in one call; if it was
// granted a lease meanwhile, that call gives the lease back, so a waiter
// that returns an error never holds a lease. If that call fails (Redis
// unreachable, the engine's breaker open, its reply lost), the keeper
// sends it again every poll interval until it succeeds; Redis drops the
// waiter, and a lease granted to it, within the TTL in any case (or, if
// the key's waiters set was lost meanwhile, when the waiter reaches the
// head of the queue, where it is dropped rather than granted). The
// keeper does the same for a waiter that leaves while a keep call that
// refreshes it is on its way, since that call may put it back in the
// queue, and for one granted and released meanwhile; that leave call
// gives back only a grant made after the release, never the lease
// released, whose release call it may overtake.
// And it does the same for a lease whose Release failed (its ctx ended,
// Redis unreachable): the lease's leave call goes every poll interval
// until it reaches Redis, so the lease is given back once Redis answers,
// not held from the others until the TTL.
//
// # Cost
//
// Acquire without contention is one Redis call, Release one. A waiter
// adds the blocking read that wakes it, shared with its process's other
// waiters, and the polls while it waits. Extensions are one call per
// process and key every TTL/3, however many leases it holds.
//
// A blocking read takes a connection of the client's pool for up to a
// poll interval at a time (at most a second; a second on a client whose
// ReadTimeout is under two, through its own BLPop, which go-redis lets
// outlast the ReadTimeout) through the engine's gate
// (throttle.Engine.HoldConn): blocking reads hold at most half the pool,
// so that they never starve the calls that grant, release and extend
// leases. On a single node the
// process's one read takes one connection; a key that begins waiting
// while the read is out, and is not named in it, ends it with one call
// (a push to a list of the process's own), so that the next read names
// it. One read names at most 512 keys: a process waiting on more at once
// has each read name a random choice of them. On a Cluster or a Ring
// each key with waiters takes a connection of its node, and a key that
// finds none to spare is served by the poll alone: a grant by another
// process reaches its waiter within a poll interval. There, size the
// client's PoolSize above twice the keys a process waits on at once for
// every wake-up to be immediate.
//
// # Keys
//
// For subject key under name, the keys are name:{key}:lease:h (holders
// scored by expiry), :t (tokens), :q (queue), :w (waiters by expiry),
// :n:<process> (wake-up lists), :l (waiters that gave up, for a TTL, so
// that an acquire or keep call their leave call overtook does not queue
// them again) and :c (the counter of arrivals and tokens), under the
// engine's prefix; on a single node, name:lease:wake:
// <process> is the list that ends a process's blocking read early. They share the hash tag {key}, the
// rate keys' tag, so a Redis Cluster holds them on one node, and all but
// the counter expire when the subject is idle. The counter is kept so
// that tokens stay monotonic; it is one small integer per subject ever
// leased. Tokens are monotonic only as long as Redis keeps the counter:
// a Redis restarted without persistence, or a failover to a replica that
// had not received the last grants, starts it again lower, so a resource
// that fences by token should run against a Redis that persists (AOF) and
// fails over without losing writes (or use WAIT-backed replicas). Such a
// Redis loses the leases too: another process may take a place at once,
// while its holder learns of the loss (Lost) only at its next extension,
// up to TTL/3 later.
//
// # Rate and concurrency together
//
// Take the lease first, then the slot (pool.WithLease and
// asynqadapter.LeaseMiddleware do so). Booking a slot and then waiting for
// a lease lets the slot pass unused and, when leases come back, starts the
// jobs whose slots have passed all at once: a burst the rate limit never
// granted. Holding a lease while sleeping until the slot keeps both limits
// exact; what it wastes is the lease's idle time, which the rate
// limiter's max wait bounds.
//
// # Errors
//
// Bad input (a nil engine, an empty name, N <= 0, a TTL under MinTTL, an
// empty key) is an error matching ErrInvalid, and no Redis call is made.
// Redis failures are the engine's (throttle.ErrUnavailable,
// throttle.ErrReplyLost), wrapped; an Acquire whose reply was lost leaves
// the queue before it returns, or, when that call fails too, soon after
// (see Waiting). ErrClosed is returned once the Semaphore is closed.
//
// # Metrics
//
// WithObserver reports leases held and waiters (per process), wait times,
// and leases that lapsed because their holder stopped extending them.
// NewCollector returns an Observer that keeps them as Prometheus metrics.
package lease
