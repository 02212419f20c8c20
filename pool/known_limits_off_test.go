//go:build !slotbook_known_limits

package pool_test

// knownLimits: see known_limits_test.go.
const knownLimits = false
