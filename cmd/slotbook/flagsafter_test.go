package main

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/throttle"
)

// TestFlagAfterCommand: a flag after the command is a usage error that
// names it; after "--", arguments that look like flags are subjects, and
// ones that name no flag ("-", "-x") always were.
func TestFlagAfterCommand(t *testing.T) {
	t.Parallel()
	err := run(context.Background(), []string{"-redis", "redis://127.0.0.1:1", "inspect", "api", "-json"}, &bytes.Buffer{})
	require.ErrorIs(t, err, errUsage)
	require.Contains(t, err.Error(), "-json")

	e := rvNewEnv(t, "")
	lim := e.limiter(t, "api", throttle.Every(10*time.Second, 1, 1))
	for _, s := range []string{"-json", "-", "-x", "--"} {
		e.book(t, lim, s, 1)
	}
	fr := e.runJSON(t, "inspect", "api", "--", "-json", "-", "-x", "--")
	require.Equal(t, 4, fr.Subjects)
	for _, s := range fr.Top {
		require.True(t, s.Keys[0].Exists, s.Subject)
	}
	e.run(t, "reset", "api", "--", "-json")
	_, ok := e.tatOf(t, keys0(e.prefix, "-json"))
	require.False(t, ok)
	fr = e.runJSON(t, "inspect", "api", "-", "-x")
	require.Equal(t, 2, fr.Subjects)
}
