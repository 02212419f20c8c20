// Package throttle is slotbook's engine: GCRA (the generic cell rate
// algorithm) in Redis, one integer per limited subject.
//
// Each key holds TAT, the theoretical arrival time of the next request, in
// whole microseconds on the Redis clock (TIME, read inside the scripts, so
// client clocks never matter), stored int-encoded with an expiry at TAT so
// idle subjects cost nothing. With I = Period/Rate (rounded up to a
// microsecond) and tau = Burst*I, booking n units with max wait W is
//
//	tat  = max(stored TAT or now, now)
//	wait = max(0, tat + (n-1)*I - tau - now)
//	wait > W:  refuse, write nothing, report wait (the exact retry-after)
//	otherwise: store tat + n*I, report wait
//
// Check mode (Allow) is booking with W = 0. BookBatch judges many requests
// for one key in one call; BookAll judges several limits of one subject
// together (their keys share a Redis Cluster hash tag); Refund gives a
// booking back, once, and only while nothing booked after it stands on it,
// so that a refund can never let anything through early; Block holds a key
// back after an upstream 429, and no refund undoes it; Reset clears a
// subject; AllowWindow is an exact sliding-window log for small limits.
//
// A stored value the engine did not write (not an integer count of
// microseconds up to 2^53, or further ahead than MaxHorizon plus the
// limit's burst) is an error matching ErrCorruptState that names the key.
//
// Every call has a tight timeout. Errors are classed deliberately:
//
//	class                     errors                               caller sees          breaker
//	unavailable, not sent     dial failed, connection refused, a   ErrUnavailable       opens
//	                          new connection not made in time, a
//	                          broken connection found on writing
//	                          (the command was not written whole);
//	                          Redis refused to run it: LOADING,
//	                          MASTERDOWN, BUSY, CLUSTERDOWN, and
//	                          writes refused: OOM (maxmemory,
//	                          noeviction), READONLY (a replica
//	                          after a failover), MISCONF,
//	                          NOREPLICAS
//	one slot resharding       TRYAGAIN: a Cluster slot migrating,  ErrUnavailable       stays closed
//	                          some of the call's keys (a layered
//	                          subject's) on the node and some
//	                          not; nothing ran, and the master
//	                          serves its other slots
//	unavailable, reply lost   timeout after sending (a stopped or  ErrUnavailable +     opens
//	                          paused server, CLIENT PAUSE), broken ErrReplyLost
//	                          connection while reading the reply:
//	                          the script may have run
//	breaker open              refused at once, sent nowhere (see   ErrUnavailable +     stays open
//	                          below)                               ErrBreakerOpen
//	client saturated          the client's own pool had no         ErrUnavailable       unchanged
//	                          connection in time: a pool timeout,
//	                          or the timeout passed while the call
//	                          waited its turn in a pool whose
//	                          every connection is open and in use
//	                          (by other work on the client: a
//	                          BLPOP of package lease, asynq), or
//	                          the call came to its connection with
//	                          its time up (a write that timed out)
//	caller gave up            the caller's context ended, or its   ctx.Err() (+         unchanged
//	                          deadline passed before the engine's  ErrReplyLost if sent)
//	                          timeout (the socket's deadline can
//	                          fire before the context says so)
//	configuration or data     NOAUTH, WRONGPASS, NOPERM,           Redis's error as is  stays closed
//	                          WRONGTYPE, ErrCorruptState, any
//	                          other error reply
//	reply unreadable          a reply that came but is not what    ErrReplyLost         stays closed
//	                          the script answers: it ran
//
// A fallback (package reserve) answers only for ErrUnavailable: a wrong
// password or a missing ACL permission is a mistake to fix, not an outage
// to ride out, and FailOpen must not hide it. A saturated client is not
// Redis's fault and never opens the breaker, so that load alone cannot
// turn the limit over to the fallback. (The engine's own calls on a
// Client, or on a ClusterClient per node, queue for a pooled connection
// before their timeout starts, so they rarely see it; other work on the
// same client is not counted there, and a client whose pool is held by
// blocking commands fails the engine's calls as saturated: give such work
// a client of its own, or a pool with room for it.) A call that waited
// inside the client never reached Redis, so it never reports ErrReplyLost.
//
// The timeout (WithTimeout) must cover a reconnect, not just a round trip:
// a call that finds no idle connection dials and says HELLO (and AUTH)
// within the same timeout, two round trips more than the call itself, and
// more with TLS. A call that times out costs its connection (go-redis
// closes it), so with a timeout below that, calls under load keep
// dialing and never get through. The probe of an open breaker, one call
// at a time, may take four times the timeout, so that it can reconnect
// and close the breaker where ordinary calls could not.
//
// While a node's breaker is open, calls that were queued at the engine's
// gate for a connection fail at once when they get it, unless one is the
// probe; a call sent before the breaker opened that fails after it does
// not delay the next probe.
//
// Single bookings (one request under one limit) that find every
// connection busy, or four bookings already in flight (WithMergeAt), are
// merged (WithMerging, on by default, for a client that is not a
// Cluster's): they wait together for one of those calls to come back, and
// go out in one call, each judged as it would be alone. Redis runs one
// command at a time, so calls beyond a few in flight would only queue
// there, each paying its own round of work in the client and the server.
// The wait for one of the four is short (WithMergeWait, 250µs by default):
// if none has come back by then, Redis is far away and the calls in flight
// are on the wire, so the batch goes out beside them. A merged call is
// one call for the breaker and the timeout, and for the Observer one for
// each limiter name among its keys (ObserveCall); each booking's error is
// the call's: a lost reply is ErrReplyLost for every booking in it. A
// request leaves while it waits, as a call at the gate does; once sent,
// its answer comes with the call's, bounded by the engine's timeout rather
// than by its own context (a caller whose context ends meanwhile gets its
// context's error, with ErrReplyLost only if the reply was lost to the
// engine's timeout, and its booking is given back, as for a call alone:
// see BookAll). A booking whose key
// holds a value that is not a TAT, or cannot be written (out of memory),
// or that the server refuses the call for (NOPERM: an ACL user may not
// touch one of the keys) is sent again alone, and gets its own answer. A
// server that wants every call's keys in one hash slot (CROSSSLOT, MOVED
// or ASK: a cluster-enabled node, or a proxy in front of shards) has the
// call's bookings sent again alone, and the engine merges no more.
//
// The engine keeps one breaker per Redis node, the failure domain: the
// client's server, or, for a Redis Cluster, the master that owns the key's
// slot, or, for a Ring, the shard the key goes to. While a node's breaker is open calls for its subjects fail at once
// (a fallback answers for them), one probe at a time checks whether it is
// back, and subjects on other masters are served as usual. An Observer
// (package metrics has one) sees every decision and call, and every
// breaker change in the order it happened.
//
// Most programs use package reserve on top of this one.
package throttle
