package slotbook_test

import (
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

var readmePath = flag.String("readme", "README.md", "the README whose Go blocks TestReadmeGoBlocks compiles")

// A goBlock is one ```go block of the README.
type goBlock struct {
	line int    // the README line of its first line of code
	code string // its text
}

// readmeGoBlocks returns every ```go block of the markdown text md.
func readmeGoBlocks(md string) []goBlock {
	var blocks []goBlock
	lines := strings.Split(md, "\n")
	for i := 0; i < len(lines); i++ {
		if strings.TrimSpace(lines[i]) != "```go" {
			continue
		}
		start := i + 1
		for i++; i < len(lines) && strings.TrimSpace(lines[i]) != "```"; i++ {
		}
		blocks = append(blocks, goBlock{line: start + 1, code: strings.Join(lines[start:i], "\n") + "\n"})
	}
	return blocks
}

// fragmentScaffold is the file a README fragment is compiled in. The rule,
// which README fragments follow:
//
//   - a block that starts with a package clause is a whole file, built as
//     it stands (a program: package main);
//   - any other block is the body of a function returning error (so it may
//     `return err`; `return nil` is added unless it ends in a return), in a
//     package that imports context, errors, time, go-redis, deadline,
//     pool, reserve and throttle, and declares what a reader has at hand: ctx, eng
//     (*throttle.Engine), lim (*reserve.Limiter), p (*pool.Pool), tasks (a
//     channel of strings), callStripe(ctx) error and handle(task).
//
// Everything a fragment declares must be used, as in any Go function.
const fragmentScaffold = `// Code generated from %[1]s by readme_test.go. DO NOT EDIT.

package %[2]s

import (
	"context"
	"errors"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/pool"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

var (
	ctx   = context.Background()
	eng   *throttle.Engine
	lim   *reserve.Limiter
	p     *pool.Pool
	tasks chan string
)

func callStripe(context.Context) error { return nil }

func handle(string) {}

// Every import in use, whichever the fragment needs.
var (
	_ = errors.Is
	_ = time.Second
	_ = redis.NewClient
	_ = deadline.ErrWouldExceedDeadline
	_ = pool.New
	_ = reserve.New
	_ = throttle.New
	_ = ctx
	_ = eng
	_ = lim
	_ = p
	_ = tasks
	_ = callStripe
	_ = handle
)

func fragment() error {
//line %[1]s:%[3]d
%[4]s%[5]s}
`

// TestReadmeGoBlocks compiles every Go block of README.md (fragments by
// the rule of fragmentScaffold) in a module of its own that requires this
// one, and vets them, so that what a reader copies compiles. Where
// staticcheck is installed it also checks that no value, such as an err,
// is assigned and never used.
func TestReadmeGoBlocks(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the README's code: skipped with -short")
	}
	md, err := os.ReadFile(*readmePath)
	require.NoError(t, err)
	blocks := readmeGoBlocks(string(md))
	require.GreaterOrEqual(t, len(blocks), 2, "README.md has Go blocks")

	root, err := filepath.Abs(".")
	require.NoError(t, err)
	dir := t.TempDir()
	gomod, err := os.ReadFile("go.mod")
	require.NoError(t, err)
	mod := strings.Replace(string(gomod), "module github.com/slotbook/slotbook",
		"module example.com/readme\n\nrequire github.com/slotbook/slotbook v0.0.0\n\nreplace github.com/slotbook/slotbook => "+root, 1)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "go.mod"), []byte(mod), 0o644))
	sum, err := os.ReadFile("go.sum")
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "go.sum"), sum, 0o644))

	name := filepath.Base(*readmePath)
	programs, fragments := 0, 0
	for _, b := range blocks {
		pkg := fmt.Sprintf("line%d", b.line)
		var src string
		if isWholeFile(b.code) {
			programs++
			src = fmt.Sprintf("//line %s:%d\n%s", name, b.line, b.code)
		} else {
			fragments++
			end := "\treturn nil\n"
			if endsInReturn(b.code) {
				end = ""
			}
			src = fmt.Sprintf(fragmentScaffold, name, pkg, b.line, b.code, end)
		}
		require.NoError(t, os.MkdirAll(filepath.Join(dir, pkg), 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(dir, pkg, "block.go"), []byte(src), 0o644))
	}
	t.Logf("%s: %d programs and %d fragments", name, programs, fragments)

	run := func(tool string, args ...string) {
		t.Helper()
		cmd := exec.Command(tool, args...)
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "GOFLAGS=-mod=mod")
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "%s %s: the README's Go blocks do not pass (package lineN holds the block at README line N):\n%s",
			filepath.Base(tool), strings.Join(args, " "), out)
	}
	run("go", "vet", "./...")
	if sc := staticcheckPath(); sc != "" {
		run(sc, "-checks", "SA4006", "./...") // a value assigned and never used
	} else {
		t.Log("staticcheck not found: not checked for values assigned and never used")
	}
}

// isWholeFile reports whether a block is a Go file of its own: its first
// line that is not blank or a comment is a package clause.
func isWholeFile(code string) bool {
	for _, l := range strings.Split(code, "\n") {
		l = strings.TrimSpace(l)
		if l == "" || strings.HasPrefix(l, "//") {
			continue
		}
		return strings.HasPrefix(l, "package ")
	}
	return false
}

// endsInReturn reports whether a fragment's last statement, at the top
// level of its function, is a return.
func endsInReturn(code string) bool {
	lines := strings.Split(strings.TrimRight(code, "\n"), "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		l := lines[i]
		if strings.TrimSpace(l) == "" || strings.HasPrefix(strings.TrimSpace(l), "//") {
			continue
		}
		return strings.HasPrefix(l, "return ") || l == "return"
	}
	return false
}

// staticcheckPath returns the staticcheck command, or "" if it is not
// installed (on PATH or in GOPATH/bin).
func staticcheckPath() string {
	if p, err := exec.LookPath("staticcheck"); err == nil {
		return p
	}
	out, err := exec.Command("go", "env", "GOPATH").Output()
	if err != nil {
		return ""
	}
	p := filepath.Join(strings.TrimSpace(string(out)), "bin", "staticcheck")
	if _, err := os.Stat(p); err != nil {
		return ""
	}
	return p
}
