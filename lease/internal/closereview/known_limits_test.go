//go:build slotbook_known_limits

package closereview_test

// knownLimits is set under the build tag slotbook_known_limits (go test
// -tags slotbook_known_limits ./lease/...): tests then also fail on the
// documented limits they otherwise only log.
const knownLimits = true
