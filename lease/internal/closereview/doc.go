// Package closereview holds no code. Its tests are adversarial reviews of
// package lease's Close and leave calls from its 45th to 47th stops:
// Close under races and lost replies, spare tokens, the order of leave
// calls (seq45, spare45, close45, close46), and Close with Redis slow,
// stopped or away (close47*): the gone waiters' leave calls sent past the
// engine's open breaker, side by side, again when they reached no Redis,
// and dropped once Redis is judged away or every Close under way has
// given up; go-redis's dial lockout, a known limit that the build tag
// slotbook_known_limits makes fail. Through lease's public API and
// go-redis hooks on an engine's client, on the rig of package
// lease/internal/leasetest. They live apart from package leasereview (the
// later reviews of Close, leave calls and releases) and package
// keepreview (keep calls and admission) so that no test binary, each
// running its tests one after another, comes near go test's default
// ten-minute timeout.
package closereview
