// Android library module for kerntun. Run ./build.sh first: it builds the
// native libraries (cargo-ndk) and generates the Kotlin bindings into
// kerntun/build/generated/, which the module compiles and packages.
pluginManagement {
    repositories {
        google()
        mavenCentral()
        gradlePluginPortal()
    }
}

dependencyResolutionManagement {
    repositoriesMode.set(RepositoriesMode.FAIL_ON_PROJECT_REPOS)
    repositories {
        google()
        mavenCentral()
    }
}

rootProject.name = "kerntun-android"
include(":kerntun")
