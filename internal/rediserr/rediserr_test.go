package rediserr

import (
	"errors"
	"fmt"
	"testing"
)

// replyError is an error Redis answered, as go-redis hands it on (its own
// type is internal to go-redis).
type replyError string

func (e replyError) Error() string { return string(e) }
func (replyError) RedisError()     {}

func TestWrongType(t *testing.T) {
	for _, c := range []struct {
		err  error
		want bool
	}{
		// Redis 7: the call's own error, with the script named after it.
		{replyError("WRONGTYPE Operation against a key holding the wrong kind of value script: f54da4e96ccb360235a7ad30d96d71d6f3779d51, on @user_script:51."), true},
		// A command's WRONGTYPE, wrapped by the caller.
		{fmt.Errorf("lease: acquire %q: %w", "k", replyError("WRONGTYPE Operation against a key holding the wrong kind of value")), true},
		// Redis before 7 (redis/redis#3128): the call's error inside ERR.
		{replyError("ERR Error running script (call to f_a4a677c981cf90a000d00ae8096afec853b8ba93): @user_script:1: WRONGTYPE Operation against a key holding the wrong kind of value"), true},
		// Other errors Redis answers, some of which pass.
		{replyError("ERR Error running script (call to f_a4a677c981cf90a000d00ae8096afec853b8ba93): @user_script:1: user_script:1: attempt to compare nil with number"), false},
		{replyError("BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSCRIPT."), false},
		{replyError("NOPERM this user has no permissions to run the 'evalsha' command"), false},
		{replyError("ERR value is not an integer or out of range"), false},
		{replyError("LOADING Redis is loading the dataset in memory"), false},
		// Not Redis's answer at all, though it names WRONGTYPE.
		{errors.New("WRONGTYPE"), false},
		{nil, false},
	} {
		if got := WrongType(c.err); got != c.want {
			t.Errorf("WrongType(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}
