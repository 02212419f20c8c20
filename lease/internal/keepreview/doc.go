// Package keepreview holds no code. Its tests are adversarial reviews of
// package lease's keep calls and admission: the keeper's retries after a
// failed keep call (stop 44), admission under churn, lost replies and a
// deleted waiters set (stop 45), and the hand-out judge of
// review_side5_test.go, through lease's public API and go-redis hooks on
// an engine's client, on the rig of package lease/internal/leasetest.
// They live apart from package leasereview (the reviews of Close and of
// leave calls) so that neither test binary, each running its tests one
// after another, comes near go test's default ten-minute timeout:
// together they took about 460 s.
package keepreview
