//go:build !slotbook_known_limits

package lease_test

// knownLimits: see known_limits_test.go.
const knownLimits = false
