//go:build slotbook_known_limits

package pool_test

// knownLimits is set under the build tag slotbook_known_limits (go test
// -tags slotbook_known_limits ./pool): tests then also fail on the
// documented limits they otherwise only log.
const knownLimits = true
