package main

import (
	"strconv"
	"strings"
	"time"
)

// This file is the one place the CLI reads slotbook's key layout (package
// reserve writes it): a limiter name's subject s holds its first limit at
//
//	prefix + name + ":{" + s + "}"
//
// and each further limit at that key plus ":" + its period. The period
// suffix is read tolerantly: the milliseconds form ("86400000ms", wire
// protocol 2), Go's Duration string ("24h0m0s", protocol 1) and a bare
// count of milliseconds all parse. A refund's tombstone (the key plus
// ":x:" and an id) is not a limit's key and is skipped.

// subjectPattern returns the SCAN MATCH pattern for the keys of name's
// subjects (subject "": every subject).
func subjectPattern(prefix, name, subject string) string {
	p := globEscape(prefix + name + ":{")
	if subject == "" {
		return p + "*"
	}
	return p + globEscape(subject+"}") + "*"
}

// firstKey returns the key (before the prefix) of subject's first limit.
func firstKey(name, subject string) string { return name + ":{" + subject + "}" }

// furtherKey returns the key (before the prefix) of a further limit of
// the given period, given the first limit's key: the period in whole
// milliseconds, as package reserve names it (wire protocol 2).
func furtherKey(first string, period time.Duration) string {
	return first + ":" + strconv.FormatInt(period.Milliseconds(), 10) + "ms"
}

// parseKey splits a full key found under name into its subject and its
// period (0 for the first limit's key). ok is false for a key that is no
// limit's key of name (a tombstone, another name's key, a stray key).
func parseKey(full, prefix, name string) (subject string, period time.Duration, ok bool) {
	rest, found := strings.CutPrefix(full, prefix+name+":{")
	if !found {
		return "", 0, false
	}
	if s, found := strings.CutSuffix(rest, "}"); found {
		return s, 0, true
	}
	i := strings.LastIndex(rest, "}:")
	if i < 0 {
		return "", 0, false
	}
	d, ok := parsePeriod(rest[i+2:])
	if !ok {
		return "", 0, false
	}
	return rest[:i], d, true
}

// parsePeriod reads a key's period suffix.
func parsePeriod(s string) (time.Duration, bool) {
	if ms, err := strconv.ParseInt(s, 10, 64); err == nil {
		if ms <= 0 || ms > int64(time.Duration(1<<63-1)/time.Millisecond) {
			return 0, false
		}
		return time.Duration(ms) * time.Millisecond, true
	}
	if s == "" || s[0] < '0' || s[0] > '9' { // "x:..." (a tombstone), "-1s"
		return 0, false
	}
	d, err := time.ParseDuration(s)
	return d, err == nil && d > 0
}

// globEscape escapes the characters SCAN's MATCH treats specially.
func globEscape(s string) string {
	var b strings.Builder
	for _, r := range s {
		switch r {
		case '*', '?', '[', ']', '\\', '^', '-':
			b.WriteByte('\\')
		}
		b.WriteRune(r)
	}
	return b.String()
}
