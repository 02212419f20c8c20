//go:build !slotbook_known_limits

package closereview_test

// knownLimits: see known_limits_test.go.
const knownLimits = false
