//! The git commit the extension is built from, for `ft --version` (`FT_GIT_COMMIT` in the environment wins:
//! a build from a source archive has no .git; "unknown" otherwise). Only this small crate rebuilds on a new
//! commit.

use std::path::PathBuf;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).current_dir(env!("CARGO_MANIFEST_DIR")).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (out.status.success() && !text.is_empty()).then_some(text)
}

fn main() {
    println!("cargo:rerun-if-env-changed=FT_GIT_COMMIT");
    let commit = std::env::var("FT_GIT_COMMIT").ok().filter(|c| !c.is_empty()).or_else(|| {
        let git_dir = PathBuf::from(git(&["rev-parse", "--absolute-git-dir"])?);
        let common = PathBuf::from(git(&["rev-parse", "--path-format=absolute", "--git-common-dir"])?);
        // A new commit moves HEAD or the branch it names (loose or packed; a worktree keeps its refs in the
        // common directory). A missing path would rerun this every build: watch only those that exist.
        let watched = [git_dir.join("HEAD"), common.join("refs/heads"), common.join("packed-refs")];
        for path in watched.iter().filter(|p| p.exists()) {
            println!("cargo:rerun-if-changed={}", path.display());
        }
        git(&["rev-parse", "--short=12", "HEAD"])
    });
    println!("cargo:rustc-env=FT_GIT_COMMIT={}", commit.unwrap_or_else(|| "unknown".into()));
}
