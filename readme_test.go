package slotbook_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestReadmeAsynqProgram builds the asynq program in README.md as a module
// of its own that requires this one, so the README's promise that it works
// when copied into a new program stays true.
func TestReadmeAsynqProgram(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a program: skipped with -short")
	}
	readme, err := os.ReadFile("README.md")
	require.NoError(t, err)
	_, after, ok := strings.Cut(string(readme), "<!-- readme-asynq-program -->\n```go\n")
	require.True(t, ok, "README.md lost its asynq program marker")
	program, _, ok := strings.Cut(after, "```")
	require.True(t, ok)

	root, err := filepath.Abs(".")
	require.NoError(t, err)
	dir := t.TempDir()
	gomod, err := os.ReadFile("go.mod")
	require.NoError(t, err)
	mod := strings.Replace(string(gomod), "module github.com/slotbook/slotbook",
		"module example.com/copied\n\nrequire github.com/slotbook/slotbook v0.0.0\n\nreplace github.com/slotbook/slotbook => "+root, 1)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "go.mod"), []byte(mod), 0o644))
	sum, err := os.ReadFile("go.sum")
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "go.sum"), sum, 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "main.go"), []byte(program), 0o644))

	cmd := exec.Command("go", "build", "-o", os.DevNull, ".")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GOFLAGS=-mod=mod")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "the README's asynq program does not build:\n%s", out)
}
