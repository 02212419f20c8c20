package throttle

import (
	"context"
	_ "embed"
	"fmt"
	"time"
)

var (
	//go:embed scripts/state.lua
	stateSrc    string
	stateScript = newScript(clockSrc + stateSrc)
)

// A State is what a subject's keys hold at one moment on the Redis clock,
// read by Engine.State without booking anything. The zero State is an
// empty reading. A State is a plain value, safe to copy.
type State struct {
	// Now is the Redis clock when the keys were read.
	Now time.Time
	// Keys holds each key's state, in the order the keys were given.
	Keys []KeyState
	// Wait is how long a one-unit request made at Now would wait for its
	// slot under every limit: the queue booked ahead of it. It is 0 when
	// the limits were not given (they decide it).
	Wait time.Duration
	// NextFree is the slot such a request would get: Now + Wait.
	NextFree time.Time
	// Available is how many units would pass at Now without waiting (the
	// fewest any limit has), from 0 to Burst+1. It is 0 when the limits
	// were not given.
	Available int
	// Backlog is the time until every key is idle again (the longest of
	// the keys' Backlog): how far ahead of Now slots have been booked.
	Backlog time.Duration
}

// KeyState is one key's part of a State.
type KeyState struct {
	// Key is the key as given (before the engine's prefix).
	Key string
	// Limit is the limit the key was read under; the zero Limit when the
	// limits were not given.
	Limit Limit
	// Exists reports whether the key holds a TAT. An idle subject's keys
	// do not exist: they expire once their TAT has passed.
	Exists bool
	// TAT is the stored theoretical arrival time on the Redis clock (the
	// zero Time when the key does not exist).
	TAT time.Time
	// TTL is the key's time to live: 0 when it does not exist, negative
	// when it has no expiry (slotbook never writes such a key).
	TTL time.Duration
	// Backlog is max(0, TAT - Now): how far ahead of Now this key's limit
	// is booked.
	Backlog time.Duration
	// Wait and Available are State's Wait and Available under this key's
	// limit alone (0 when the limit was not given).
	Wait      time.Duration
	Available int
}

// State reads keys (the keys of one subject, one per limit, sharing a hash
// tag when there are several, as for BookAll) without changing them, in
// one Redis call: it books nothing and spends no quota. limits, if given,
// holds each key's Limit (keys[i] under limits[i]) and then State reports
// the wait, the next free slot and the units available now; nil reads the
// keys alone (an operator's tool that found keys without knowing their
// limits).
//
// A stored value that is not a TAT is an error matching ErrCorruptState,
// as for every other call; Reset clears it. Bad input (no keys, more than
// MaxLimits, a bad key or limit, keys without a shared hash tag) is an
// error matching ErrInvalidRequest or ErrInvalidLimit, with no Redis call
// made. Redis failures are classed as for every call (ErrUnavailable).
func (e *Engine) State(ctx context.Context, keys []string, limits []Limit) (State, error) {
	if limits == nil {
		if err := checkKeys(keys); err != nil {
			return State{}, err
		}
	} else if err := checkKeysLimits(keys, limits); err != nil {
		return State{}, err
	}
	args := make([]any, 0, 1+2*len(limits))
	args = append(args, nowArg(ctx))
	for _, l := range limits {
		I := l.intervalMicros()
		args = append(args, I, l.tauMicros())
	}
	vals, err := e.run(ctx, stateScript, keys, args, 1+3*len(keys))
	if err != nil {
		return State{}, fmt.Errorf("throttle: state %q: %w", keys[0], err)
	}
	now := vals[0]
	s := State{Now: time.UnixMicro(now), Keys: make([]KeyState, len(keys))}
	if limits != nil {
		s.Available = MaxBatch
	}
	for i, k := range keys {
		v := vals[1+3*i : 4+3*i]
		ks := KeyState{Key: k, Exists: v[0] == 1}
		tat := now // an absent key is idle: as if its TAT were now
		if ks.Exists {
			tat = max(v[1], now)
			ks.TAT = time.UnixMicro(v[1])
			ks.Backlog = time.Duration(max(0, v[1]-now)) * time.Microsecond
		}
		switch ttl := v[2]; {
		case ttl >= 0:
			ks.TTL = time.Duration(ttl) * time.Millisecond
		case ttl == -1:
			ks.TTL = -1
		}
		if limits != nil {
			l := limits[i]
			I := l.intervalMicros()
			tau := l.tauMicros()
			ks.Limit = l
			ks.Wait = time.Duration(max(0, tat-tau-now)) * time.Microsecond
			// As AllowAll's Remaining: floor((now + tau - tat) / I) + 1 units
			// fit now, at most Burst+1.
			ks.Available = int(max(0, min(floorDiv(now+tau-tat, I)+1, int64(l.Burst)+1)))
			s.Wait = max(s.Wait, ks.Wait)
			s.Available = min(s.Available, ks.Available)
		}
		s.Backlog = max(s.Backlog, ks.Backlog)
		s.Keys[i] = ks
	}
	s.NextFree = s.Now.Add(s.Wait)
	return s, nil
}

// checkKeys validates keys read without their limits: 1 to MaxLimits
// acceptable keys, none twice, sharing a hash tag when there are several.
func checkKeys(keys []string) error {
	if len(keys) == 0 || len(keys) > MaxLimits {
		return fmt.Errorf("%w: %d keys (want 1 to %d)", ErrInvalidRequest, len(keys), MaxLimits)
	}
	for i, k := range keys {
		if err := CheckKey(k); err != nil {
			return err
		}
		for _, k2 := range keys[:i] {
			if k == k2 {
				return fmt.Errorf("%w: key %q given twice", ErrInvalidRequest, k)
			}
		}
		if i > 0 && (HashTag(k) == "" || HashTag(k) != HashTag(keys[0])) {
			return fmt.Errorf("%w: keys %q and %q do not share a hash tag, so a Redis Cluster may hold them on different nodes",
				ErrInvalidRequest, keys[0], k)
		}
	}
	return nil
}
