// Package leasereview holds no code. Its tests are adversarial reviews of
// package lease's Close, leave calls and releases from its 48th stop on:
// a Close retried after one that gave up, releases that fail (before or
// once Close has begun), Redis judged away node by node on a Cluster or a
// Ring. Through lease's public API and go-redis hooks on an engine's
// client, on the rig of package lease/internal/leasetest. They live apart
// from lease's own tests, from the earlier reviews of Close (package
// lease/internal/closereview) and from those of keep calls and admission
// (package lease/internal/keepreview), so that no test binary, each
// running its tests one after another, comes near go test's default
// ten-minute timeout.
package leasereview
