package throttle

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// A RetryIndex names, for BookRetry, the sorted set of booked retries of
// one subject (package asynqadapter keeps one per limiter key: tasks sent
// back to their queue to run at a slot booked for them) and this request's
// part in it.
type RetryIndex struct {
	// Key is the index's key (before the engine's prefix), with the same
	// hash tag as the rate keys.
	Key string
	// Member names this request's booking in the index: a task id.
	Member string
	// KeepFrom: a booking whose wait is longer than this is recorded in
	// the index under Member (its caller will not wait for it now).
	KeepFrom time.Duration
	// Window: the reply lists the index's bookings whose slots lie at most
	// this far ahead (Due), at most MaxDue of them, the soonest first, and
	// if Since is positive only those whose slots passed at most Since ago
	// (entries of tasks that never came back stay in the index for a
	// minute after their slots, and would crowd out those due).
	Window time.Duration
	MaxDue int
	Since  time.Duration
	// Forget lists members to take out of the index (their bookings used).
	Forget []string
}

// A RetryBooking is BookRetry's answer.
type RetryBooking struct {
	Booking
	// Recalled reports that Member was in the index: nothing was booked
	// (no decision is reported to the Observer: it was when the slot was
	// booked), the entry is taken out, and Booking holds the recorded slot
	// (OK, At; Wait is 0 if the slot has passed). A recalled booking
	// cannot be given back with Refund; its caller can put it back in the
	// index, until its slot, with RestoreRetry.
	Recalled bool
	// Recorded reports that the booking was recorded in the index.
	Recorded bool
	// Now is the Redis clock at the decision.
	Now time.Time
	// Due lists the index's bookings due within Window, by member.
	Due map[string]time.Time
}

// retrySpent: an index entry whose slot passed this long ago is dropped
// (its task never came back: deleted, archived, or gone elsewhere).
const retrySpent = time.Minute

var bookRetryScript = newScript(clockSrc + retryPrelude + bookRetryBody())

// retryPrelude takes BookRetry's arguments off the end of ARGV (so that
// book.lua reads its own as usual), forgets used entries, drops spent
// ones, and answers at once for a member already in the index.
const retryPrelude = `
local idx_key = KEYS[#KEYS]
local idx_nforget = tonumber(table.remove(ARGV))
local idx_forget = {}
for i = 1, idx_nforget do idx_forget[i] = table.remove(ARGV) end
local idx_since = tonumber(table.remove(ARGV))
local idx_spent = tonumber(table.remove(ARGV))
local idx_max = tonumber(table.remove(ARGV))
local idx_window = tonumber(table.remove(ARGV))
local idx_keep = tonumber(table.remove(ARGV))
local idx_member = table.remove(ARGV)
if #idx_forget > 0 then redis.call('ZREM', idx_key, unpack(idx_forget)) end
redis.call('ZREMRANGEBYSCORE', idx_key, '-inf', '(' .. string.format('%d', now - idx_spent))
local idx_from = '-inf'
if idx_since > 0 then idx_from = string.format('%d', now - idx_since) end
local function idx_due()
  return redis.call('ZRANGEBYSCORE', idx_key, idx_from, string.format('%d', now + idx_window), 'WITHSCORES', 'LIMIT', 0, idx_max)
end
local idx_have = redis.call('ZSCORE', idx_key, idx_member)
if idx_have then
  redis.call('ZREM', idx_key, idx_member)
  return {now, 2, tonumber(idx_have) - now, idx_due()}
end
`

// retryTail records the booking in the index if its wait exceeds
// KeepFrom, keeps the index alive until its last entry is spent, and
// answers {now, status (0 refused, 1 booked, 3 booked and recorded),
// wait, tat_1 .. tat_m, the due entries}, from book.lua's reply for the
// one request {now, tat_1 .. tat_m, booked (1 or 0)}, its wait worked out
// from the TATs it was judged against as book.lua works it out.
const retryTail = `
local n, slot = ARGV[4 + 2 * m] + 0, now
for i = 1, m do
  local at = out[1 + i] + (n - 1) * interval[i] - tau[i]
  if at > slot then slot = at end
end
local status, wait = out[#out], slot - now
if status == 1 and wait > idx_keep then
  redis.call('ZADD', idx_key, string.format('%d', now + wait), idx_member)
  local last = redis.call('ZRANGE', idx_key, -1, -1, 'WITHSCORES')
  local ttl = math.ceil((tonumber(last[2]) - now + idx_spent) / 1000) + 1
  redis.call('PEXPIRE', idx_key, string.format('%d', ttl))
  status = 3
end
local reply = {now, status, wait}
for i = 1, m do reply[3 + i] = out[1 + i] end
reply[4 + m] = idx_due()
return reply
`

// bookRetryBody is book.lua with retryTail in place of its final return.
func bookRetryBody() string {
	body := strings.TrimRight(bookSrc, "\n ")
	if !strings.HasSuffix(body, "return out") {
		panic("throttle: book.lua no longer ends in 'return out'")
	}
	return strings.TrimSuffix(body, "return out") + retryTail
}

// BookRetry is BookAll for one request that also keeps an index of booked
// retries (package asynqadapter's): in the same script call, if
// idx.Member is in the index it answers with its recorded slot, booking
// nothing (Recalled); otherwise it books the request as BookAll does and,
// if the booking's wait is longer than idx.KeepFrom, records it in the
// index under idx.Member. Entries are dropped a minute after their slot,
// when listed in idx.Forget, or when recalled. The reply lists the
// index's entries due within idx.Window (and passed at most idx.Since
// ago, if positive). A recorded booking given back (RefundAll) stays in the
// index: list its member in a later call's Forget, or a BookRetry for the
// same member recalls a slot that was given back.
func (e *Engine) BookRetry(ctx context.Context, keys []string, limits []Limit, req Request, idx RetryIndex) (RetryBooking, error) {
	if err := checkKeysLimits(keys, limits); err != nil {
		return RetryBooking{}, err
	}
	for _, l := range limits {
		if err := checkRequest(req, l); err != nil {
			return RetryBooking{}, err
		}
	}
	if idx.Member == "" || strings.ContainsAny(idx.Member, "\x00") || HashTag(idx.Key) != HashTag(keys[0]) || idx.MaxDue < 0 || idx.Since < 0 {
		return RetryBooking{}, fmt.Errorf("%w: retry index %q, member %q: want a member, the rate keys' hash tag, and MaxDue and Since not negative", ErrInvalidRequest, idx.Key, idx.Member)
	}
	m := len(keys)
	args := make([]any, 0, 2+2*m+3+7+len(idx.Forget))
	args = append(args, nowArg(ctx), m)
	for _, l := range limits {
		I := l.intervalMicros()
		args = append(args, I, l.tauMicros())
	}
	args = append(args, 1, req.N, req.maxWaitMicros()) // book.lua's run of one request
	args = append(args, idx.Member, int64(idx.KeepFrom/time.Microsecond), int64(idx.Window/time.Microsecond), idx.MaxDue,
		int64(retrySpent/time.Microsecond), int64((idx.Since+time.Microsecond-1)/time.Microsecond)) // Since rounded up: a positive one stays positive
	for i := len(idx.Forget) - 1; i >= 0; i-- { // popped from the end
		args = append(args, idx.Forget[i])
	}
	args = append(args, len(idx.Forget))

	reply, err := e.runReply(ctx, bookRetryScript, append(append([]string(nil), keys...), idx.Key), args)
	if err != nil {
		return RetryBooking{}, fmt.Errorf("throttle: book retry %q: %w", keys[0], err)
	}
	// A reply that came but cannot be read: the script ran, and may have
	// booked.
	unread := func(format string, a ...any) (RetryBooking, error) {
		return RetryBooking{}, fmt.Errorf("throttle: book retry %q: %w", keys[0], unreadable(fmt.Errorf(format, a...)))
	}
	arr, ok := reply.([]any)
	if !ok || len(arr) < 4 {
		return unread("unexpected reply %T", reply)
	}
	ints, err := int64s(arr[:3], 3)
	if err != nil {
		return unread("%w", err)
	}
	now, status, wait := ints[0], ints[1], ints[2]
	out := RetryBooking{Now: time.UnixMicro(now)}
	due, ok := arr[len(arr)-1].([]any)
	if !ok || len(due)%2 != 0 {
		return unread("unexpected due list %T", arr[len(arr)-1])
	}
	out.Due = make(map[string]time.Time, len(due)/2)
	for i := 0; i < len(due); i += 2 {
		member, ok1 := due[i].(string)
		score, ok2 := due[i+1].(string)
		at, err := strconv.ParseInt(score, 10, 64)
		if !ok1 || !ok2 || err != nil {
			return unread("unexpected due entry %v %v", due[i], due[i+1])
		}
		out.Due[member] = time.UnixMicro(at)
	}
	if status == 2 {
		out.Recalled = true
		out.Booking = Booking{OK: true, N: req.N, Wait: time.Duration(max(wait, 0)) * time.Microsecond, At: time.UnixMicro(now + wait), now: now}
		return out, nil // booked before, and reported then
	}
	if status < 0 || status > 3 {
		return unread("unexpected reply: status %d", status)
	}
	// judge works the booking out from the TATs the script judged it
	// against, as for BookAll, and checks that the reply agrees (booked
	// exactly when within the max wait); the wait must be the one they
	// give. vals: {now, tat_1 .. tat_m, booked}, then room for the ends.
	tats, err := int64s(arr[3:len(arr)-1], m)
	if err != nil {
		return unread("%w", err)
	}
	vals := make([]int64, 2+2*m)
	vals[0] = now
	copy(vals[1:], tats)
	if status != 0 {
		vals[1+m] = 1
	}
	bs, err := judge(vals, limits, []Request{req}, nil)
	if err != nil {
		return unread("%w", err)
	}
	b := bs[0]
	if b.Wait != time.Duration(wait)*time.Microsecond {
		return unread("unexpected reply: wait %dµs, %v by the TATs", wait, b.Wait)
	}
	if b.OK {
		e.observer.ObserveDecision(label(keys[0]), Booked, b.Wait)
	} else {
		e.observer.ObserveDecision(label(keys[0]), Refused, b.Wait)
	}
	out.Booking = b
	out.Recorded = status == 3
	return out, nil
}

var restoreRetryScript = newScript(clockSrc + `
local at = tonumber(ARGV[3])
if at <= now then return 0 end
for i = 2, #KEYS do
  local tat = tonumber(redis.call('GET', KEYS[i]))
  if not tat or tat < at then return 0 end
end
if redis.call('ZADD', KEYS[1], 'NX', ARGV[3], ARGV[2]) == 0 then return 0 end
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
local ttl = math.ceil((tonumber(last[2]) - now + tonumber(ARGV[4])) / 1000) + 1
redis.call('PEXPIRE', KEYS[1], string.format('%d', ttl))
return 1
`)

// RestoreRetry puts the booking rb, recalled by BookRetry from the index
// idx.Key under idx.Member for keys (BookRetry's), back in the index, for a
// later BookRetry of the same member to recall again: for a caller that
// will not act on it after all (package asynqadapter's task cut short
// before its slot, which asynq runs again as the same attempt). Call it
// once per recall: the booking is its caller's to put back, and a second
// call after another recall would offer it twice. It does so only while
// the slot has not come on the Redis clock, so that no one can have acted
// on it; only while every key still holds a TAT at or beyond the slot, so
// that a booking lost with the keys' state (a flush, a Reset) does not
// come back beside the bookings made since; and only if the member is not
// in the index again (booked anew meanwhile). It reports whether it did.
// Other fields of idx are not used.
func (e *Engine) RestoreRetry(ctx context.Context, keys []string, idx RetryIndex, rb RetryBooking) (bool, error) {
	if idx.Member == "" || strings.ContainsAny(idx.Member, "\x00") || !rb.Recalled || !rb.OK || len(keys) == 0 || len(keys) > MaxLimits {
		return false, fmt.Errorf("%w: retry index %q, member %q: want a member, a recalled booking and its keys", ErrInvalidRequest, idx.Key, idx.Member)
	}
	all := append([]string{idx.Key}, keys...)
	for _, k := range all {
		if err := CheckKey(k); err != nil {
			return false, err
		}
		if HashTag(k) != HashTag(idx.Key) {
			return false, fmt.Errorf("%w: retry index %q and key %q: want one hash tag", ErrInvalidRequest, idx.Key, k)
		}
	}
	at := strconv.FormatInt(rb.At.UnixMicro(), 10)
	reply, err := e.runReply(ctx, restoreRetryScript, all, []any{nowArg(ctx), idx.Member, at, int64(retrySpent / time.Microsecond)})
	if err != nil {
		return false, fmt.Errorf("throttle: restore retry %q: %w", idx.Key, err)
	}
	put, ok := reply.(int64)
	if !ok {
		return false, fmt.Errorf("throttle: restore retry %q: %w", idx.Key, unreadable(fmt.Errorf("unexpected reply %T", reply)))
	}
	return put == 1, nil
}

var forgetRetryScript = newScript(`redis.call('ZREM', KEYS[1], ARGV[1])
return 0`)

// ForgetRetry takes idx.Member out of the index idx.Key, in a call of its
// own, for a caller that must be sure no later BookRetry recalls it before
// it acts: package asynqadapter's, before it gives a recorded booking back
// (RefundAll), so that the task run again cannot recall a slot given to
// someone else. (BookRetry's idx.Forget does the same in the caller's next
// booking call.) Other fields of idx are not used.
func (e *Engine) ForgetRetry(ctx context.Context, idx RetryIndex) error {
	if idx.Member == "" || strings.ContainsAny(idx.Member, "\x00") {
		return fmt.Errorf("%w: retry index %q, member %q: want a member", ErrInvalidRequest, idx.Key, idx.Member)
	}
	if err := CheckKey(idx.Key); err != nil {
		return err
	}
	if _, err := e.runReply(ctx, forgetRetryScript, []string{idx.Key}, []any{idx.Member}); err != nil {
		return fmt.Errorf("throttle: forget retry %q: %w", idx.Key, err)
	}
	return nil
}
