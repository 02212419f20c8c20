// Package pool runs jobs under a shared rate limit with fewer than one
// Redis call per job. A Pool knows its backlog, so it books slots for many
// jobs in one reserve.Limiter.ReserveBatch call, sleeps until each job's
// slot, then runs it.
//
// What a Pool guarantees:
//
//   - Rate. A job's function starts no earlier than the slot booked for it
//     (Job.Slot, the local time of a slot measured on the Redis clock: the
//     reservation's SlotAt, or for a slot handed down to it, see
//     Cancellation, as its own reply tells it), so the jobs of every pool
//     and process sharing the limiter's name and key keep to its limit
//     together.
//   - Concurrency. A job holds one of the pool's workers from the moment
//     its batch is sent until its function returns (or its booking has been
//     given back), so at most Workers jobs are booking, booked or running at
//     once, counting the callers of Pool.Acquire, which take workers from
//     the same set. A worker given back goes first to an Acquire caller
//     waiting for one, otherwise to the backlog at once.
//   - Batches. The pool books a batch for a key up to the key's share of
//     the free workers, and waits until many workers are free before
//     booking again unless few jobs are left booked: a backlog costs far
//     fewer than one Redis call per job. Keys with backlog take turns; the
//     batches of different keys are booked side by side (one batch per key
//     at a time), and single bookings merge where every connection is
//     busy or a few are already in flight (throttle.WithMergeAt).
//   - Leases. With WithLease, a job also holds a lease of a
//     lease.Semaphore for its key (at most N across every process): it
//     takes the lease first, then books its slot alone (not in a batch),
//     and gives the lease back when it is done or goes back to the
//     backlog. See WithLease for why the lease comes first.
//   - Refusals. A job whose slot would leave too little time before its
//     context's deadline books nothing and ends with the refusal
//     (deadline.ErrWouldExceedDeadline, carrying the exact retry-after). A
//     job refused only by the limiter's max wait is not refused for good: it
//     goes back to the front of the backlog, and its key is not booked again
//     until the slot would fit.
//   - Cancellation. A job whose context ends before its function starts
//     does not run. If it was booked, no one acted on its booking (the
//     pool forgoes it: reserve's Reservation.Forgo), so it can give its
//     room back even once its slot has come; and its slot is handed down:
//     the booked jobs of its key that are still wanted take the key's
//     earliest slots, in their order (each starts at a slot no later than
//     its own), and the slots left over, the latest, are given back. A
//     booking gives its room back only while no later booking stands on
//     its key, so the pool gives back the latest first, before the job
//     reports done, unless a booking call of the key is in flight (it may
//     book after them; with WithLease, jobs book one by one) or a wanted
//     booking that cannot change hands (below) stands above. Then the job
//     reports done at once and its booking is owed: handed down in turn
//     once it can be, given back once nothing wanted stands on it (so jobs
//     cancelled in any order give back all their room), or forgotten once
//     a later job of its key has started on it or its units have lapsed
//     (throttle's Booking.End): either way it could give nothing back.
//     (A known limit: a late refusal's booking whose slot has passed by
//     the time its reply is in, under which a job or caller booked in a
//     later call starts, so goes unused, its room lost to the key until
//     its units lapse: TestReviewOnTop46SeparateCalls.)
//     Only slots that have not come change hands (a slot passed unused is
//     not run late; a job's replies tell it the Redis clock, so a slot
//     handed to it starts as early as its own reply or the booking's
//     allows, never later than its own slot would have), and only
//     bookings made in Redis, not a fallback's. A booking refused on
//     arrival, because the reply's latency left its job too little time or
//     its job's context ended while the call was out, is held and owed the
//     same way (its job reports done with the refusal, or its context's
//     error): a later job of its key may run in its slot (reserve's
//     Reservation.Claim). Jobs of a key booked in one call within a burst
//     share a slot (with WithLease, in one merged call, and their replies
//     come in any order): a job of that slot that runs on top of a held
//     booking, before or after the refusal's reply is in, trades bookings
//     with it (reserve's Reservation.Trade), and its own, the later, goes
//     back instead. Job.Reservation hands out a view: a caller's Cancel of
//     it cannot get in the way. The pool sees its Acquire callers'
//     bookings as it sees its jobs': a caller books alone (HoldLate, as a
//     job with WithLease does) once the pool's give-backs of its key are
//     in; while its call is out or it sleeps until its slot, no booking of
//     its key that the caller's may stand on is given back, and a slot
//     under it that will not be used is handed down to it (it acts
//     earlier); once it acts, a held booking of its slot under it trades
//     with it; and a booking of a caller that will not act (its context
//     ended while the call was out or while it slept, the reply too late
//     for its deadline, or the pool closed) is owed like a cancelled
//     job's.
//   - Failures. A batch whose Redis call fails ends its jobs with the error
//     (a lost reply may have booked; nothing is given back for it).
//   - Panics. A job's panic becomes its error, a *PanicError with the panic
//     value and the stack; a job whose function calls runtime.Goexit ends
//     with an error saying so. Either way its worker is given back and the
//     pool goes on.
//   - Close. No more jobs are accepted, queued jobs end with ErrClosed,
//     bookings not started are given back (their jobs end with ErrClosed),
//     Acquire callers still waiting for a worker or sleeping until their
//     slot get ErrClosed, and Close waits for running jobs, for booking
//     calls in flight (the pool's and its Acquire callers'), and for every
//     goroutine the pool started.
//
// Inside, every job is in one of six states (queued, booking, booked,
// running, refunding, done), and one function moves a job from one to the
// next, keeping the backlog, the key turns, the workers and the count of
// unfinished jobs consistent with the job's state and waking the
// dispatcher.
package pool
