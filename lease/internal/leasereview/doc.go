// Package leasereview holds no code. Its tests are adversarial reviews of
// package lease's Close and leave calls (those of its 45th to 48th stops:
// Close under races, lost replies, a breaker open or Redis away, spare
// tokens, the order of leave calls, a Close retried after one that gave
// up, releases that fail once Close has begun), through lease's public
// API and go-redis hooks on an engine's client, on the rig of package
// lease/internal/leasetest. They live apart from lease's own tests, and
// the reviews of keep calls and admission from them (package
// lease/internal/keepreview), so that no test binary, each running its
// tests one after another, comes near go test's default ten-minute
// timeout.
package leasereview
