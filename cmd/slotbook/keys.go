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
// and each further limit at that key plus ":" + its period in whole
// milliseconds ("86400000ms", wire protocol 2). A key whose period is
// Go's Duration string instead ("24h0m0s") is of protocol 1's layout: the
// library no longer reads it (docs/PROTOCOL.md, "Upgrading from version
// 1"), and the CLI reports it as such. A refund's tombstone (the key plus
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
// period (0 for the first limit's key); v1 reports a further key of
// protocol 1's layout. ok is false for a key that is no limit's key of
// name (a tombstone, another name's key, a stray key).
func parseKey(full, prefix, name string) (subject string, period time.Duration, v1, ok bool) {
	rest, found := strings.CutPrefix(full, prefix+name+":{")
	if !found {
		return "", 0, false, false
	}
	if s, found := strings.CutSuffix(rest, "}"); found {
		return s, 0, false, true
	}
	i := strings.LastIndex(rest, "}:")
	if i < 0 {
		return "", 0, false, false
	}
	d, v1, ok := parsePeriod(rest[i+2:])
	if !ok {
		return "", 0, false, false
	}
	return rest[:i], d, v1, true
}

// parsePeriod reads a key's period suffix: whole milliseconds and "ms"
// (protocol 2, as furtherKey writes it), or else Go's Duration string
// (protocol 1: v1). ok is false for anything else ("x:..." of a
// tombstone, "-1s", "1000").
func parsePeriod(s string) (d time.Duration, v1, ok bool) {
	if digits, found := strings.CutSuffix(s, "ms"); found && digits != "" && digits[0] != '0' &&
		strings.Trim(digits, "0123456789") == "" {
		if ms, err := strconv.ParseInt(digits, 10, 64); err == nil && ms <= int64(time.Duration(1<<63-1)/time.Millisecond) {
			return time.Duration(ms) * time.Millisecond, false, true
		}
	}
	d, err := time.ParseDuration(s)
	if err != nil || d <= 0 || d.String() != s {
		return 0, false, false
	}
	return d, true, true
}

// globEscape escapes the characters SCAN's MATCH treats specially.
func globEscape(s string) string {
	var b strings.Builder
	for i := range len(s) { // bytes, not runes: a subject need not be UTF-8
		switch s[i] {
		case '*', '?', '[', ']', '\\', '^', '-':
			b.WriteByte('\\')
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
